"""Adafactor's statistics in checkpoints, factored (optim/factored_form.py): each entry has the
rows' or the columns' shape; the state comes back bitwise through a save and a load (TP2 with
each rank's own statistics; DP2 with the distributed optimizer, matrices cut between the ranks;
fully parallel and with one writer), through a reshard TP1 -> TP2 -> TP1, and from a checkpoint
of the broadcast form written before it (tests/fixtures/adafactor_broadcast)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.integrity import check_files
from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.metadata import metadata_config, metadata_table, read_metadata
from megatron_p2r.checkpoint.naming import entry_name, resolve_iteration_dir
from megatron_p2r.checkpoint.tensor_table import ShardLayout
from megatron_p2r.convert.reshard import Target, convert
from megatron_p2r.optim.factored_form import FACTOR_KINDS, entry_shape
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import cfg_of
from tests.checkpoint.factored_workers import CASES, save_and_load
from tests.helpers import run_steps

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "adafactor_broadcast")
sys.path.insert(0, FIXTURE)
from make_fixture import FLAGS as FIXTURE_FLAGS  # noqa: E402  (the fixture's model)

# the fixture's layers as its code built them: 0 dense, 1 MoE (an integer --moe-layer-freq N meant
# layers N-1, 2N-1, ... then; its metadata.json, without the marker, is read so)
FLAGS = {**FIXTURE_FLAGS, "moe_layer_freq": [0, 1]}

sys.path.remove(FIXTURE)


def _statistics(state) -> dict:
    return {(n, k): v for n, p in state.model.named_parameters() for k, v in state.optimizer.state[p].items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _entries(path: str) -> dict:
    iter_dir = resolve_iteration_dir(path)
    meta = read_metadata(iter_dir)
    readers = check_files(iter_dir, meta)
    return {
        (name, e): readers(name).read(e)
        for name in ShardLayout.of(metadata_config(meta)).files()
        for e in readers(name).names()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("factored")
    _, state = run_steps(cfg_of(**FLAGS), ParallelState.single(), 2)
    save_checkpoint(str(root / "tp1"), state)
    return root, state


def test_entries_are_rows_and_columns(saved):
    """row_var drops the weight's last dimension, col_var the one before (a vector: () and its
    variance); the optimizer's entries take 4 (R + C) bytes per matrix, not 8 R C."""
    root, _ = saved
    iter_dir = resolve_iteration_dir(str(root / "tp1"))
    meta = read_metadata(iter_dir)
    assert meta["factored_statistics"] is True
    entries, stats, weights = _entries(str(root / "tp1")), 0, 0
    for info in metadata_table(meta).values():
        weights += info.numel
        for kind in FACTOR_KINDS:
            value = entries[("mp_rank_00_000_000.safetensors", entry_name(kind, info.key))]
            assert tuple(value.shape) == entry_shape(info.shape, kind), (info.key, kind)
            stats += value.numel()
    assert stats < 0.2 * weights


def test_reshard_tp1_tp2_tp1_is_bitwise_and_resumes_bitwise(saved):
    root, state = saved
    convert(str(root / "tp1"), str(root / "tp2"), Target(tensor_parallel_size=2), None, progress=False)
    convert(str(root / "tp2"), str(root / "back"), Target(tensor_parallel_size=1), None, progress=False)
    original, back = _entries(str(root / "tp1")), _entries(str(root / "back"))
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    tp2 = _entries(str(root / "tp2"))  # a row-parallel weight's row statistic: each TP rank its own copy
    key = entry_name("row_var", "layers.0.mlp.fc2.weight")
    assert torch.equal(tp2[("mp_rank_00_000_000.safetensors", key)], tp2[("mp_rank_01_000_000.safetensors", key)])
    c = cfg_of(**FLAGS)
    fresh = build_train_state(c, ParallelState.single())
    load_checkpoint(str(root / "back"), fresh)
    assert _same(_statistics(fresh), _statistics(state))
    assert (
        run_steps(c, ParallelState.single(), 2, load=str(root / "back"))[0]
        == run_steps(c, ParallelState.single(), 2, load=str(root / "tp1"))[0]
    )


def test_an_older_broadcast_checkpoint_loads_and_converts(tmp_path):
    """The fixture (statistics broadcast to the weight's shape, no factored_statistics) loads
    into the statistics it was saved from, bitwise; resharded to TP2 and back it is written
    factored and still loads them."""
    want = load_file(os.path.join(FIXTURE, "state.safetensors"))
    want = {tuple(k.split("/")): v for k, v in want.items()}
    ckpt = os.path.join(FIXTURE, "ckpt")
    assert "factored_statistics" not in read_metadata(resolve_iteration_dir(ckpt))
    convert(ckpt, str(tmp_path / "tp2"), Target(tensor_parallel_size=2), None, progress=False)
    convert(str(tmp_path / "tp2"), str(tmp_path / "tp1"), Target(tensor_parallel_size=1), None, progress=False)
    # written before the router had a bias: the run says so (the load's error names the flag)
    with pytest.raises(CheckpointError, match=r"moe_router_bias = False, this run has True \(--no-moe-router-bias\)"):
        load_checkpoint(ckpt, build_train_state(cfg_of(**FLAGS), ParallelState.single()))
    for path in (ckpt, str(tmp_path / "tp1")):
        state = build_train_state(cfg_of(**FLAGS, moe_router_bias=False), ParallelState.single())
        load_checkpoint(path, state)
        assert _same(_statistics(state), want), path
    assert read_metadata(resolve_iteration_dir(str(tmp_path / "tp1")))["factored_statistics"] is True


def test_tp2_and_cut_matrices_save_and_load_bitwise(tmp_path):
    results = run_distributed(save_and_load, 2, str(tmp_path))
    for case in CASES:
        for r in results:
            assert r[case]["same"] == {"par": True, "single": True}, case
            assert r[case]["resumed"] == r[case]["straight"][2:], case
    assert any(r["dp2-distopt"]["cut"] for r in results)  # a matrix is cut between the two ranks' shards


def test_a_tp2_checkpoint_merges_each_ranks_statistics_by_their_mean(tmp_path):
    """Resharded to TP1, a statistic each TP2 rank kept of its own shard (a row-parallel weight's
    rows, a column-parallel weight's columns) is the mean of the two ranks'."""
    run_distributed(save_and_load, 2, str(tmp_path))
    src = str(tmp_path / "tp2" / "single")
    convert(src, str(tmp_path / "tp1"), Target(tensor_parallel_size=1), None, progress=False)
    tp2, tp1 = _entries(src), _entries(str(tmp_path / "tp1"))
    for kind, weight in (("row_var", "layers.0.mlp.fc2.weight"), ("col_var", "layers.0.mlp.fc1.weight")):
        key = entry_name(kind, weight)
        ranks = [tp2[(f"mp_rank_0{t}_000_000.safetensors", key)] for t in range(2)]
        assert not torch.equal(*ranks)
        assert torch.equal(tp1[("mp_rank_00_000_000.safetensors", key)], torch.stack(ranks).mean(0))
    assert math.isfinite(
        float(tp1[("mp_rank_00_000_000.safetensors", entry_name("col_var", "final_norm.weight"))].sum())
    )
