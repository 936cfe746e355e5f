"""The files of an HF model directory: shard sizes and their planning."""

from megatron_p2r.convert.hf.directory import parse_size, plan_shards


def test_sizes_and_shard_plan():
    assert parse_size("64KB") == 64000 and parse_size("2MiB") == 2**21
    assert plan_shards([[("a", "F32", (10,))], [("b", "F32", (10,))], [("c", "F32", (30,))]], 80) == [[0, 1], [2]]
