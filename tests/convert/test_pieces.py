"""A table's pieces written into a layout's shard files, and read back whole."""

import torch

from megatron_p2r.convert.pieces import read_global, write_pieces
from megatron_p2r.checkpoint.safetensors_io import ReaderCache
from megatron_p2r.checkpoint.tensor_table import ShardLayout, file_entries, tensor_table
from tests.helpers import tiny_config


def test_written_files_hold_what_the_table_places_and_read_back_whole(tmp_path):
    """TP=2 x PP=3, pseudo phase sharing one slot: the middle stage only replays the slot of
    stage 0, so it owns no piece, yet its files exist (empty) as the layout says. Every piece
    has distinct values; the shards of a column- and a row-parallel weight are compared with
    slices along the dimension each is known to be split on."""
    cfg = tiny_config(
        num_layers=3,
        p2r_phase="pseudo",
        share_pattern="all",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
    )
    table, layout = tensor_table(cfg), ShardLayout.of(cfg)
    values = {
        key: torch.arange(info.numel, dtype=torch.float32).reshape(info.shape) + 1000 * i
        for i, (key, info) in enumerate(table.items())
    }
    write_pieces(
        str(tmp_path), table, layout, ("model",), lambda info, kind: values[info.key], progress=False, desc="test"
    )
    readers = ReaderCache(str(tmp_path))
    expected = file_entries(table, layout, ("model",))
    assert expected["mp_rank_00_001_000.safetensors"] == [] == expected["mp_rank_01_001_000.safetensors"]
    for name, entries in expected.items():
        stored = [(n, e["dtype"], tuple(e["shape"])) for n, e in readers(name).entries.items()]
        assert stored == [(n, dtype, tuple(shape)) for n, dtype, shape in entries], name
    for key, info in table.items():
        assert torch.equal(read_global(readers, layout, info, "model"), values[key]), key
    for key, dim in (("layers.0.attention.qkv.weight", 0), ("layers.0.attention.proj.weight", 1)):
        half = table[key].shape[dim] // 2
        assert torch.equal(readers(layout.file_of(table[key], 1)).read(key), values[key].narrow(dim, half, half)), key
