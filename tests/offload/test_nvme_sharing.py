"""One --cpu-offload-optimizer-nvme-path directory, two runs (issue 38, bug 1): each rank's state
file is locked for as long as its run lives, so a second run is refused, naming the first run's
pid, before it resizes or writes a file the first has mapped (it used to shrink it under the first
run: a bus error, or the first run silently training on the second's moments). A run SIGKILLed
with its state on NVMe leaves a lock the next run takes over, and resumes bitwise; a directory
deleted under a running run changes nothing for that run."""

from __future__ import annotations

import fcntl
import os
import re
import time

import pytest
import torch.multiprocessing as mp

from tests.harness import PRELOAD
from tests.reliability.common import FLAGS, checkpoint_tensor_files, launch, _rank_main

ARGV = FLAGS + ["--train-iters", "6", "--save-interval", "2", "--cpu-offload-layers", "1"]


def _start(argv, env, out):
    """A run in a process of its own (forked from the harness's forkserver), not waited for."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    proc = ctx.Process(target=_rank_main, args=(list(argv), dict(env, OMP_NUM_THREADS="1"), out))
    proc.start()
    return proc


def _saved(log):
    """Whether the run logging to ``log`` has saved its first checkpoint."""
    return os.path.exists(log) and "saved checkpoint" in open(log, errors="replace").read()


def _wait_for(predicate, proc, timeout=120.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.is_alive(), "the first run exited before it was expected to"
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first(tmp_path, capsys):
    """Run A (stalled 15 s before iteration 3) holds n/; run B, smaller (which used to shrink A's
    file), is refused with one error line naming A's pid; A's file is untouched and A finishes."""
    import pretrain_m6

    nvme_dir = tmp_path / "n"
    nvme_dir.mkdir()
    a = _start(
        ARGV + ["--save", str(tmp_path / "a"), "--cpu-offload-optimizer-nvme-path", str(nvme_dir)],
        {"P2R_FAULT": "stall:3:15"},
        str(tmp_path / "a.log"),
    )
    try:
        state = nvme_dir / "optimizer-state-rank00000.bin"
        _wait_for(lambda: _saved(tmp_path / "a.log"), a)
        before = (state.stat().st_size, state.stat().st_mtime_ns, state.read_bytes())
        small = [*ARGV, "--hidden-size", "16", "--seed", "2", "--save", str(tmp_path / "b")]
        rc = pretrain_m6.main(small + ["--cpu-offload-optimizer-nvme-path", str(nvme_dir)])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        assert re.fullmatch(
            rf"error: --cpu-offload-optimizer-nvme-path '{nvme_dir}': {state} is in use by training "
            rf"run \(optimizer state of rank 0\) \(pid {a.pid} on host .*\); one file takes one writer "
            r"at a time: .*two runs never share optimizer-state files: give each run its own "
            r"directory\n",
            err,
        ), err
        assert (state.stat().st_size, state.stat().st_mtime_ns, state.read_bytes()) == before
        assert a.is_alive()
        # the other ranks' files of the same directory are free (a job's ranks share one directory)
        assert not (nvme_dir / "optimizer-state-rank00001.lock").exists()
    finally:
        a.join(120)
    assert a.exitcode == 0, (tmp_path / "a.log").read_text()
    with open(nvme_dir / "optimizer-state-rank00000.lock", "rb") as fh:  # the harness's os._exit leaves the
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # file (atexit removes it): free


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run with its state on NVMe: checkpoints at 2, 4, 6."""
    root = tmp_path_factory.mktemp("nvme_reference")
    (root / "n").mkdir()
    results = launch(
        ARGV + ["--save", str(root / "ck"), "--cpu-offload-optimizer-nvme-path", str(root / "n")], out_dir=str(root)
    )
    assert [rc for rc, _ in results] == [0], results
    return root / "ck"


def test_a_run_sigkilled_with_its_state_on_nvme_resumes_bitwise(reference, tmp_path):
    """SIGKILL after iteration 3 (checkpoint at 2): the lock file is left, its holder dead; the
    relaunch takes it over (and says so), loads iteration 2 into the mapped file and ends with the
    uninterrupted run's exact state."""
    nvme_dir, ck = tmp_path / "n", tmp_path / "ck"
    nvme_dir.mkdir()
    argv = ARGV + ["--save", str(ck), "--load", str(ck), "--cpu-offload-optimizer-nvme-path", str(nvme_dir)]
    first = launch(argv, env={"P2R_FAULT": "kill_after_iter:3"}, out_dir=str(tmp_path))
    assert first[0][0] == -9, first
    assert (nvme_dir / "optimizer-state-rank00000.lock").exists()
    second = launch(argv, out_dir=str(tmp_path))
    assert second[0][0] == 0, second
    assert "optimizer-state-rank00000.bin: took over the lock" not in second[0][1]
    assert re.search(
        r"--cpu-offload-optimizer-nvme-path .*: took over the lock of training run \(optimizer state "
        r"of rank 0\) \(pid \d+ .*\), which is no longer running",
        second[0][1],
    ), second[0][1]
    assert f"loaded checkpoint {ck / 'iter_0000002'}" in second[0][1]
    assert checkpoint_tensor_files(str(ck / "iter_0000006")) == checkpoint_tensor_files(str(reference / "iter_0000006"))


def test_the_directory_deleted_under_a_run(reference, tmp_path):
    """The mapping outlives the directory's name: the run trains on, saves and exits 0 with the
    uninterrupted run's exact state (a directory made read-only: tests/checkpoint/test_lock.py)."""
    nvme_dir, ck = tmp_path / "n", tmp_path / "ck"
    nvme_dir.mkdir()
    run = _start(
        ARGV + ["--save", str(ck), "--cpu-offload-optimizer-nvme-path", str(nvme_dir)],
        {"P2R_FAULT": "stall:3:5"},
        str(tmp_path / "run.log"),
    )
    try:
        _wait_for(lambda: _saved(tmp_path / "run.log"), run)
        for name in os.listdir(nvme_dir):
            os.unlink(nvme_dir / name)
        nvme_dir.rmdir()
    finally:
        run.join(120)
    log = (tmp_path / "run.log").read_text()
    assert run.exitcode == 0 and "Traceback" not in log, log
    assert checkpoint_tensor_files(str(ck / "iter_0000006")) == checkpoint_tensor_files(str(reference / "iter_0000006"))
