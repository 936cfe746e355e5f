"""Asynchronous save (--async-save): the checkpoint holds the state at the save although training
updates it while the writer writes; it is published only once every rank's writer finished; an
exit waits for it; and it needs the fully parallel save."""

from __future__ import annotations

import os
import threading

import pytest

from megatron_p2r.checkpoint import async_save
from megatron_p2r.checkpoint.integrity import check_data, check_files
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from tests.harness import run_distributed
from tests.checkpoint.async_workers import FLAGS, async_save_and_resume, slow_writer
from tests.checkpoint.common import cfg_of


def _tensors(path: str) -> dict:
    iter_dir = resolve_iteration_dir(path)
    meta = read_metadata(iter_dir)
    shards = check_files(iter_dir, meta)
    check_data(meta, shards)
    return {(name, e): shards(name).read(e) for name in meta["parts"] for e in shards(name).names()}


def test_async_save_resumes_bitwise_dp2_distributed_optimizer(tmp_path):
    results = run_distributed(async_save_and_resume, 2, str(tmp_path))
    for r in results:
        assert r["writer_started"] and not r["latest_while_writing"]
        assert r["resumed"] == r["straight"][2:] == r["from_sync"], r
    got, want = _tensors(str(tmp_path / "async")), _tensors(str(tmp_path / "sync"))
    assert got.keys() == want.keys() and any("exp_avg_sq" in e for _, e in got)
    for key, value in want.items():
        assert got[key].equal(value), key


def test_the_planner_counts_the_host_copy(tmp_path):
    """The planner's host bytes of --async-save are the bytes the DP2 ranks copied (within 1%:
    bucket padding under the distributed optimizer; tests/planning/test_checkpoint_cost.py checks
    more layouts exactly), its stage's host figure the larger rank's, and nothing without it."""
    from megatron_p2r.layout.ranks import Layout
    from megatron_p2r.planning.checkpoint_cost import async_save_host_bytes
    from megatron_p2r.planning.estimate import make_plan
    from megatron_p2r.planning.hardware import GPU_PRESETS

    copied = [r["host_copy_bytes"] for r in run_distributed(async_save_and_resume, 2, str(tmp_path))]
    c = cfg_of(async_save=True, **FLAGS)
    planned = async_save_host_bytes(c, Layout(dp=2))
    for rank, got in enumerate(copied):
        assert abs(planned[rank] - got) <= 0.01 * got, (copied, planned)
    assert async_save_host_bytes(cfg_of(**FLAGS), Layout(dp=2)) == {}
    with_copy, without = (make_plan(cfg, 2, GPU_PRESETS["V100-32GB"]).stages[0].host for cfg in (c, cfg_of(**FLAGS)))
    assert with_copy == {**without, "async_save_copy": round(max(planned.values()))}


def test_exit_right_after_an_async_save_waits_and_publishes(tmp_path, monkeypatch):
    """The last save of a run (and the one at --exit-interval) is written and published before
    pretrain returns, although its writer is slow."""
    from megatron_p2r.training import pretrain

    release = threading.Event()
    release.set()
    monkeypatch.setattr(async_save, "write_parts", slow_writer(threading.Event(), release, delay=1.0))
    for flags, iteration in ((dict(train_iters=3), 3), (dict(train_iters=4, exit_interval=2, save_interval=2), 2)):
        save = tmp_path / str(iteration)
        pretrain(cfg_of(save=str(save), async_save=True, **flags))
        assert (save / "latest_checkpointed_iteration.txt").read_text() == str(iteration)
        assert [n for n in os.listdir(save) if n.startswith("iter_")] == [f"iter_{iteration:07d}"]
        assert _tensors(str(save))


def test_async_save_needs_the_fully_parallel_save():
    with pytest.raises(ConfigError, match="--async-save needs the fully parallel save"):
        validate(cfg_of(async_save=True, ckpt_fully_parallel_save=False), 1)
