"""Fully parallel save (every DP rank writes what it owns into part files) and parallel load:
DP2 with dropout on, with and without the distributed optimizer. The parallel checkpoint holds
the same tensors as a single-writer save of the same state, resumes bitwise, loads on one
process and into the converter; a save materialises no more than a bounded buffer; a piece
written twice or never is refused."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.integrity import check_data, check_files, layout_files
from megatron_p2r.checkpoint.metadata import metadata_config, read_metadata
from megatron_p2r.checkpoint.naming import entry_name, resolve_iteration_dir
from megatron_p2r.checkpoint.parts import PartedShard
from megatron_p2r.checkpoint.safetensors_io import ShardReader, save_tensors
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.checkpoint.common import cfg_of
from tests.checkpoint.parallel_workers import each_case, save_and_resume
from tests.helpers import run_steps

CASES = {
    "distopt": dict(use_distributed_optimizer=True),
    "replicated": {},
    # 16-bit moments, widened to the checkpoint's fp32 one tensor at a time
    "lean-moments": dict(
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        exp_avg_dtype="fp16",
        exp_avg_sq_dtype="bf16",
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def dp2_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, str(root), run_distributed(save_and_resume, 2, str(root), CASES[request.param])


def _tensors(path: str) -> dict:
    """Every entry of every shard of the checkpoint at ``path``, read whole (checksums checked)."""
    iter_dir = resolve_iteration_dir(path)
    meta = read_metadata(iter_dir)
    shards = check_files(iter_dir, meta)
    check_data(meta, shards)
    out = {}
    for name in layout_files(meta):
        for entry in shards(name).names():
            out[(name, entry)] = shards(name).read(entry)
    return out


def test_parallel_save_holds_the_single_writers_tensors(dp2_run):
    _, root, _ = dp2_run
    meta = read_metadata(resolve_iteration_dir(os.path.join(root, "par")))
    assert meta["parts"] == {
        "mp_rank_00_000_000.safetensors": [
            "mp_rank_00_000_000.rank_00000.safetensors",
            "mp_rank_00_000_000.rank_00001.safetensors",
        ]
    }
    assert "parts" not in read_metadata(resolve_iteration_dir(os.path.join(root, "single")))
    par, single = _tensors(os.path.join(root, "par")), _tensors(os.path.join(root, "single"))
    assert par.keys() == single.keys() and any("exp_avg_sq" in e for _, e in par)
    for key, value in single.items():
        assert torch.equal(par[key], value), key
    sizes = [
        os.path.getsize(os.path.join(resolve_iteration_dir(os.path.join(root, "par")), f))
        for f in meta["parts"]["mp_rank_00_000_000.safetensors"]
    ]
    assert max(sizes) < 0.75 * sum(sizes), sizes  # the two writers share the work


def test_resume_from_a_parallel_save_is_bitwise(dp2_run):
    _, _, results = dp2_run
    for r in results:
        assert r["resumed"] == r["straight"][2:]
        assert r["from_single"] == r["straight"][2:]  # the single-writer (older) format
        assert r["parallel_load"] == r["straight"][2:]


def test_parallel_load_reads_only_the_moments_a_rank_steps(dp2_run):
    name, _, results = dp2_run
    if name == "replicated":
        pytest.skip("without the distributed optimizer every rank steps every moment")
    for rank, r in enumerate(results):
        assert r["moment_reads"] == [f"mp_rank_00_000_000.rank_{rank:05d}.safetensors"]


def test_saving_materialises_a_bounded_buffer_only(dp2_run):
    """Tensor accounting: a parallel save holds at most 2x the rank's largest tensor at a time
    (the single-writer save gathers the whole shard's state on rank 0: more than its own)."""
    name, _, results = dp2_run
    for r in results:
        assert r["parallel_bytes"] <= 2 * r["largest"] + 64 * 1024, r
        assert r["parallel_bytes"] <= 0.25 * r["own_bytes"], r
    if name != "replicated":
        assert results[0]["single_bytes"] > results[0]["own_bytes"]


def test_parallel_save_loads_on_one_process_and_into_the_converter(dp2_run, tmp_path):
    _, root, _ = dp2_run
    _, from_par = run_steps(cfg_of(), ParallelState.single(), 0, load=os.path.join(root, "par"))
    _, from_single = run_steps(cfg_of(), ParallelState.single(), 0, load=os.path.join(root, "single"))
    for (n, a), (_, b) in zip(from_par.model.named_parameters(), from_single.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(from_par.optimizer.state[a][kind], from_single.optimizer.state[b][kind]), (n, kind)
    for src in ("par", "single"):
        convert(os.path.join(root, src), str(tmp_path / src), Target(tensor_parallel_size=2), progress=False)
    par, single = _tensors(str(tmp_path / "par")), _tensors(str(tmp_path / "single"))
    assert par.keys() == single.keys() and len({n for n, _ in par}) == 2
    for key, value in single.items():
        assert torch.equal(par[key], value), key


def _parts(tmp_path, fragments_by_part: dict) -> list:
    readers = []
    for part, tensors in fragments_by_part.items():
        save_tensors(str(tmp_path / part), tensors)
        readers.append(ShardReader(str(tmp_path / part)))
    return readers


def test_a_fragment_written_twice_or_never_is_refused(tmp_path):
    expected = [(entry_name("model", "w"), "F32", (2, 3))]
    w = torch.arange(6, dtype=torch.float32)
    good = _parts(tmp_path, {"a.rank_00000": {"w@0": w[:4]}, "a.rank_00001": {"w@4": w[4:]}})
    assert torch.equal(PartedShard("a", good, expected).read("w"), w.view(2, 3))
    twice = _parts(tmp_path, {"b.rank_00000": {"w@0": w[:4]}, "b.rank_00001": {"w@3": w[3:]}})
    with pytest.raises(CheckpointError, match="overlaps"):
        PartedShard("b", twice, expected)
    never = _parts(tmp_path, {"c.rank_00000": {"w@0": w[:4]}})
    with pytest.raises(CheckpointError, match="4 of its 6 elements"):
        PartedShard("c", never, expected)


@pytest.mark.parametrize("offset", ["\u00b2", "\u0664", "+4", " 4", "4\u200b"])
def test_a_fragment_offset_that_is_not_ascii_digits_is_refused(tmp_path, offset):
    """'w@²' (str.isdigit() is true, int() fails), Arabic-Indic '٤' (int() reads it): the name is
    no fragment of ours, an error naming the file, not a traceback."""
    expected = [(entry_name("model", "w"), "F32", (2, 3))]
    w = torch.arange(6, dtype=torch.float32)
    odd = _parts(tmp_path, {"d.rank_00000": {"w@0": w[:4]}, "d.rank_00001": {f"w@{offset}": w[4:]}})
    with pytest.raises(CheckpointError, match=r"d.rank_00001: holds tensor 'w@.*', which is no fragment"):
        PartedShard("d", odd, expected)


def test_the_megatron_flags():
    from megatron_p2r.arguments import parse_args

    base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "1",
        "--vocab-size",
        "64",
    ]
    default = parse_args(base).checkpoint
    assert default.ckpt_fully_parallel_save and not default.ckpt_fully_parallel_load  # Megatron-LM's defaults
    flipped = parse_args(base + ["--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load"]).checkpoint
    assert not flipped.ckpt_fully_parallel_save and flipped.ckpt_fully_parallel_load


def test_bad_parts_are_named(dp2_run, tmp_path):
    """metadata.json's parts naming a file of no shard, or a part that is missing: an error
    naming the field or the file."""
    _, root, _ = dp2_run
    src = resolve_iteration_dir(os.path.join(root, "par"))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    meta = read_metadata(str(bad))
    meta["parts"]["mp_rank_00_000_000.safetensors"][1] = "../elsewhere.safetensors"
    with pytest.raises(CheckpointError, match=r"parts\['mp_rank_00_000_000.safetensors'\] must list files named"):
        metadata_config(meta)
    os.unlink(bad / "mp_rank_00_000_000.rank_00001.safetensors")
    with pytest.raises(CheckpointError, match="missing shard .*mp_rank_00_000_000.rank_00001.safetensors"):
        check_files(str(bad), read_metadata(str(bad)))


FOUR_RANKS = {  # the distributed optimizer on 4 ranks: sharding groups across stages, experts and TP
    "pp2-dp2-pseudo": dict(
        use_distributed_optimizer=True,
        pipeline_model_parallel_size=2,
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
    ),  # pseudo slots + tied embedding
    "ep2-expert-dp2-moe": dict(
        use_distributed_optimizer=True,
        expert_model_parallel_size=2,
        num_layers=4,
        num_experts=4,
        moe_layer_freq=2,
        moe_ffn_hidden_size=24,
    ),
    "tp2-dp2": dict(use_distributed_optimizer=True, tensor_model_parallel_size=2),  # norms: one copy per TP rank
    "tp2-dp2-sp": dict(use_distributed_optimizer=True, tensor_model_parallel_size=2, sequence_parallel=True),
}


def test_four_rank_layouts_save_in_parallel(tmp_path):
    """PP2 x DP2 (pseudo slots and the tied embedding in cross-stage groups), EP2 x expert-DP2,
    TP2 x DP2 without and with sequence parallelism: the parallel save holds the single writer's tensors,
    resumes bitwise (also with parallel load) and stays within the memory bound."""
    results = run_distributed(each_case, 4, str(tmp_path), FOUR_RANKS, timeout=600)
    for name in FOUR_RANKS:
        par, single = _tensors(str(tmp_path / name / "par")), _tensors(str(tmp_path / name / "single"))
        assert par.keys() == single.keys(), name
        for key, value in single.items():
            assert torch.equal(par[key], value), (name, key)
        for r in (res[name] for res in results):
            assert r["resumed"] == r["straight"][2:] and r["parallel_load"] == r["straight"][2:], name
            assert r["parallel_bytes"] <= 2 * r["largest"] + 64 * 1024, (name, r)
