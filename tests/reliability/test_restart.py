"""Crashes: a rank SIGKILLed mid-run under torchrun --max-restarts, and SIGKILL at every point of
a save. After recovery the run's final checkpoint is bitwise the uninterrupted run's."""

import json
import os
import subprocess
import sys

import pytest

from megatron_p2r.checkpoint.integrity import check_files
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.reliability import SAVE_POINTS
from tests.harness import free_port
from tests.reliability.common import FLAGS, ROOT, checkpoint_tensor_files, launch

# DP=2: two ranks, one shard writer, and the non-finite/exit flags reduced over both.
ARGV = FLAGS + ["--global-batch-size", "4", "--train-iters", "6", "--save-interval", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run: checkpoints at 2, 4, 6."""
    root = tmp_path_factory.mktemp("reference")
    results = launch(ARGV + ["--save", str(root / "ck")], 2, out_dir=str(root))
    assert [rc for rc, _ in results] == [0, 0], results
    return root / "ck"


def _same_final_state(run_dir, reference, iteration=6):
    it = f"iter_{iteration:07d}"
    got, want = checkpoint_tensor_files(str(run_dir / it)), checkpoint_tensor_files(str(reference / it))
    assert got == want, "final tensors (weights, AdamW moments, RNG states) differ from the uninterrupted run"
    a, b = read_metadata(str(run_dir / it)), read_metadata(str(reference / it))
    for field in ("iteration", "consumed_samples", "scheduler", "scaler", "files"):
        assert a[field] == b[field], field


def _events(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_torchrun_restarts_a_killed_rank_and_finishes_bitwise(reference, tmp_path):
    """torchrun --max-restarts 1: rank 1 is SIGKILLed after iteration 3 (checkpoint at 2); the
    restarted job resumes from iteration 2 and ends with the uninterrupted run's exact state."""
    ck, events = tmp_path / "ck", tmp_path / "events.jsonl"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, P2R_FAULT="kill_after_iter:3@rank1", P2R_EVENT_LOG=str(events)
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        "--master-port",
        str(free_port()),
        "pretrain_m6.py",
        *ARGV,
        "--save",
        str(ck),
        "--load",
        str(ck),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[P2R_FAULT] rank 1: SIGKILL after iteration 3" in out and "no checkpoint in" in out
    log = _events(events)
    fault = [e for e in log if e["event"] == "fault"]
    assert [(e["rank"], e["iteration"], e["restart"]) for e in fault] == [(1, 3, 0)]
    resumed = sorted((e["rank"], e["iteration"]) for e in log if e["event"] == "resumed" and e["restart"] == 1)
    assert resumed == [(0, 2), (1, 2)]  # both ranks came back from the checkpoint of iteration 2
    after = [e for e in log if e["event"] == "iteration" and e["restart"] == 1]
    assert sorted({e["iteration"] for e in after}) == [3, 4, 5, 6]
    _same_final_state(ck, reference)
    first = min(e["time"] for e in after if e["iteration"] == 3 and e["rank"] == 0)
    print(
        f"\nrestart cost: {first - fault[0]['time']:.1f} s from SIGKILL to the next completed iteration "
        f"(1 iteration of work redone)"
    )


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_sigkill_during_save_keeps_a_loadable_latest(reference, tmp_path, point):
    """SIGKILL at ``point`` of the save of iteration 4 (--keep-last 1): latest still names a complete
    checkpoint, nothing older was removed before a newer one was complete, and the relaunched job
    cleans up (with a log line) and ends bitwise equal to the uninterrupted run."""
    ck = tmp_path / "ck"
    argv = ARGV + ["--save", str(ck), "--load", str(ck), "--keep-last", "1", "--distributed-timeout-minutes", "0.5"]
    victim = "@rank1" if point == "shards" else "@rank0"  # only rank 0 goes past the shards
    first = launch(argv, 2, env={"P2R_FAULT": f"kill_in_save:4:{point}{victim}"}, out_dir=str(tmp_path))
    victim_rank = int(victim[-1])
    assert first[victim_rank][0] == -9, first
    survivor = first[1 - victim_rank]
    assert survivor[0] in (-9, 0, 1) and "Traceback" not in survivor[1], survivor  # a clear error if it noticed
    # What a restart finds: latest names a complete checkpoint (every shard present, sizes as recorded).
    it_dir = resolve_iteration_dir(str(ck))
    check_files(it_dir, read_metadata(it_dir))
    latest = 4 if point == "prune" else 2
    assert it_dir.endswith(f"iter_{latest:07d}")
    names = set(os.listdir(ck))
    assert "iter_0000002" in names  # --keep-last removes it only after 4 is complete and recorded
    assert ("iter_0000004.tmp" in names) == (point in ("shards", "metadata", "publish"))
    second = launch(argv, 2, out_dir=str(tmp_path))
    assert [rc for rc, _ in second] == [0, 0], second
    if point in ("shards", "metadata", "publish"):
        assert f"checkpoint recovery: removed {ck / 'iter_0000004.tmp'} (left by an interrupted save)" in second[0][1]
    assert f"loaded checkpoint {ck / f'iter_{latest:07d}'}" in second[0][1]
    assert sorted(os.listdir(ck)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    _same_final_state(ck, reference)


def test_sigkill_during_an_async_write_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """--async-save: rank 1 is SIGKILLed in its background writer of iteration 4 (its files
    written, training already on iteration 5, nothing published): latest still names 2 (published
    at the save of 4), and the relaunch resumes from it and ends bitwise the uninterrupted run."""
    ck = tmp_path / "ck"
    argv = ARGV + ["--save", str(ck), "--load", str(ck), "--async-save", "--distributed-timeout-minutes", "0.5"]
    first = launch(argv, 2, env={"P2R_FAULT": "kill_in_save:4:shards@rank1"}, out_dir=str(tmp_path))
    assert first[1][0] == -9 and "Traceback" not in first[0][1], first
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert "iter_0000004.tmp" in os.listdir(ck)
    check_files(str(ck / "iter_0000002"), read_metadata(str(ck / "iter_0000002")))
    second = launch(argv, 2, out_dir=str(tmp_path))
    assert [rc for rc, _ in second] == [0, 0], second
    assert f"loaded checkpoint {ck / 'iter_0000002'}" in second[0][1]
    _same_final_state(ck, reference)
