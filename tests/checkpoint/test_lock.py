"""The directory lock: one holder at a time, who holds it said, stale locks handled."""

import errno
import json
import os
import re
import signal
import socket
import sys
import time

import pytest

from megatron_p2r.checkpoint import lock as lock_module
from megatron_p2r.checkpoint.lock import LOCK_FILE, DirectoryLock, DirectoryLocked


def _dead_pid() -> int:
    pid = 2**22 - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_a_held_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with DirectoryLock(str(tmp_path), "training run"):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(DirectoryLocked, match=rf"in use by training run \(pid {os.getpid()} on host"):
            DirectoryLock(str(tmp_path), "conversion").acquire()
    assert not (tmp_path / LOCK_FILE).exists()  # released: nothing left behind
    with DirectoryLock(str(tmp_path), "conversion"):
        pass


def test_the_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(
        json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "purpose": "training run"})
    )
    lock = DirectoryLock(str(tmp_path), "training run")
    lock.acquire()
    assert "no longer running" in lock.notes[0]
    lock.release()


def test_a_free_lock_naming_another_host_is_reported_with_the_command_that_clears_it(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "other-node", "pid": 123, "purpose": "training run"}))
    with pytest.raises(DirectoryLocked, match=rf"another machine.*\n  rm {tmp_path / LOCK_FILE}"):
        DirectoryLock(str(tmp_path), "training run").acquire()
    assert (tmp_path / LOCK_FILE).exists()


@pytest.fixture
def no_flock(monkeypatch):
    """A filesystem without flock (Lustre -o noflock): flock fails with ENOLCK."""

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", flock)


def _die_holding(directory) -> None:
    """A child process takes the lock and dies without releasing it (SIGKILL, OOM kill)."""
    pid = os.fork()
    if pid == 0:
        DirectoryLock(str(directory), "training run").acquire()
        os._exit(9)
    os.waitpid(pid, 0)


def test_without_flock_a_held_lock_refuses_and_a_dead_holders_is_taken_over(tmp_path, no_flock):
    """torchrun --max-restarts could not recover when rank 0 died: the stale lock was refused on
    every restart."""
    with DirectoryLock(str(tmp_path), "training run"):
        assert lock_module.live_holder(str(tmp_path))["pid"] == os.getpid()
        with pytest.raises(DirectoryLocked, match=r"in use by training run .* heartbeat is \d+ s old .*no flock"):
            DirectoryLock(str(tmp_path), "training run").acquire()
    _die_holding(tmp_path)
    assert (tmp_path / LOCK_FILE).exists() and lock_module.live_holder(str(tmp_path)) is None
    lock = DirectoryLock(str(tmp_path), "training run")
    lock.acquire()
    assert lock.notes[0].startswith("took over the lock of training run") and "no longer running" in lock.notes[0]
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_without_flock_another_hosts_lock_is_taken_over_once_its_heartbeat_is_stale(tmp_path, no_flock):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "other-node", "pid": 123, "purpose": "training run"}))
    with pytest.raises(DirectoryLocked, match="in use by training run \\(pid 123 on host other-node"):
        DirectoryLock(str(tmp_path), "training run").acquire()
    assert lock_module.live_holder(str(tmp_path))["host"] == "other-node"
    old = os.stat(tmp_path / LOCK_FILE).st_mtime - lock_module.STALE_AFTER_S - 1
    os.utime(tmp_path / LOCK_FILE, (old, old))
    assert lock_module.live_holder(str(tmp_path)) is None
    with DirectoryLock(str(tmp_path), "training run") as lock:
        assert "heartbeat stopped" in lock.notes[0]
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_without_flock_a_live_holder_on_this_host_keeps_its_lock_whatever_its_heartbeat(tmp_path, no_flock):
    """A stopped process (Ctrl-Z) beats no heart but is alive: its directory stays its own."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))
    os.utime(tmp_path / LOCK_FILE, (1, 1))
    with pytest.raises(DirectoryLocked, match="in use by"):
        DirectoryLock(str(tmp_path), "training run").acquire()
    assert lock_module.live_holder(str(tmp_path))["pid"] == os.getppid()


def test_without_flock_the_holder_keeps_its_heartbeat_fresh(tmp_path, no_flock, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)
    with DirectoryLock(str(tmp_path), "training run"):
        os.utime(tmp_path / LOCK_FILE, (1, 1))
        for _ in range(1000):
            if os.stat(tmp_path / LOCK_FILE).st_mtime > 1:
                break
            time.sleep(0.01)
        assert os.stat(tmp_path / LOCK_FILE).st_mtime > 1


def test_live_holder_takes_nothing(tmp_path):
    assert lock_module.live_holder(str(tmp_path)) is None
    with DirectoryLock(str(tmp_path), "training run"):
        assert lock_module.live_holder(str(tmp_path))["purpose"] == "training run"
        assert lock_module.live_holder(str(tmp_path))["purpose"] == "training run"
    _die_holding(tmp_path)
    assert lock_module.live_holder(str(tmp_path)) is None and (tmp_path / LOCK_FILE).exists()


def test_a_link_planted_at_the_lock_name_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    locked = tmp_path / "dir"
    locked.mkdir()
    os.symlink(target, locked / LOCK_FILE)
    with pytest.raises(DirectoryLocked, match="is a symbolic link"):
        DirectoryLock(str(locked), "training run").acquire()
    assert target.read_text() == "keep"


def _paused_holder(directory, tmp_path, host=None):
    """A child process that takes the lock (naming ``host`` when given), says so, then runs on;
    (pid, its stderr file). Its heartbeat beats every 0.05 s."""
    ready_r, ready_w = os.pipe()
    stderr = tmp_path / "holder.err"
    pid = os.fork()
    if pid == 0:
        try:
            sys.stderr = open(stderr, "w")  # (pytest captures the parent's)
            lock_module.HEARTBEAT_S = 0.05
            if host is not None:
                lock_module.socket.gethostname = lambda: host
            DirectoryLock(str(directory), "training run").acquire()
            os.write(ready_w, b"1")
            while True:
                time.sleep(0.01)
        finally:
            os._exit(1)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r), os.close(ready_w)
    os.kill(pid, signal.SIGSTOP)
    old = time.time() - lock_module.STALE_AFTER_S - 60  # as if paused for longer than a stale heartbeat
    os.utime(directory / LOCK_FILE, (old, old))
    return pid, stderr


def test_without_flock_a_paused_holder_on_this_host_keeps_its_lock(tmp_path, no_flock):
    """SIGSTOP: its heartbeat is minutes old, but the process lives: refused, naming it."""
    pid, _ = _paused_holder(tmp_path, tmp_path / "..")
    try:
        with pytest.raises(DirectoryLocked, match=rf"in use by training run \(pid {pid} .*heartbeat is \d+ s old"):
            DirectoryLock(str(tmp_path), "training run").acquire()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_without_flock_a_paused_holder_elsewhere_that_was_taken_over_stops_when_it_resumes(tmp_path, no_flock):
    """A holder on another host (its pid cannot be asked) paused past STALE_AFTER_S is taken over;
    when it resumes, its next heartbeat finds its lock file replaced and the process stops with
    one error line, writing nothing more: the directory keeps one writer."""
    (tmp_path / "d").mkdir()
    pid, stderr = _paused_holder(tmp_path / "d", tmp_path, host="other-node")
    with DirectoryLock(str(tmp_path / "d"), "training run") as lock:
        assert "heartbeat stopped" in lock.notes[0]
        os.kill(pid, signal.SIGCONT)
        for _ in range(2000):  # its next heartbeat is 0.05 s away
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the resumed holder kept running without its lock")
        assert os.waitstatus_to_exitcode(status) == 2
        err = stderr.read_text()
        assert re.fullmatch(
            rf"error: lost the lock on {tmp_path / 'd'}: .* was taken over while this process did "
            r"not refresh it .*\n",
            err,
        ), err
        assert json.loads((tmp_path / "d" / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_release_in_a_directory_made_read_only_leaves_the_file_for_the_next_holder(tmp_path, monkeypatch):
    lock = DirectoryLock(str(tmp_path), "training run")
    lock.acquire()

    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    with monkeypatch.context() as m:
        m.setattr(lock_module.os, "unlink", read_only)
        lock.release()  # no traceback at the end of a run
    with DirectoryLock(str(tmp_path), "training run") as again:
        assert "no longer running" in again.notes[0] or not again.notes  # flock free: taken over
