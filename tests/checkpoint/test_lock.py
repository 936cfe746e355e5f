"""The directory lock: one holder at a time, who holds it said, stale locks handled."""
import errno
import json
import os
import socket

import pytest

from megatron_p2r.checkpoint import lock as lock_module
from megatron_p2r.checkpoint.lock import LOCK_FILE, DirectoryLock, DirectoryLocked


def _dead_pid() -> int:
    pid = 2 ** 22 - 1
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
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                                  "purpose": "training run"}))
    lock = DirectoryLock(str(tmp_path), "training run")
    lock.acquire()
    assert "no longer running" in lock.notes[0]
    lock.release()


def test_a_free_lock_naming_another_host_is_reported_with_the_command_that_clears_it(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "other-node", "pid": 123, "purpose": "training run"}))
    with pytest.raises(DirectoryLocked, match=rf"another machine.*\n  rm {tmp_path / LOCK_FILE}"):
        DirectoryLock(str(tmp_path), "training run").acquire()
    assert (tmp_path / LOCK_FILE).exists()


def test_without_flock_a_stale_lock_is_reported_with_the_command_that_clears_it(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    with DirectoryLock(str(tmp_path), "training run"):
        with pytest.raises(DirectoryLocked, match="in use by training run"):
            DirectoryLock(str(tmp_path), "training run").acquire()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    with pytest.raises(DirectoryLocked, match=rf"no longer running \(stale lock\).*\n  rm {tmp_path / LOCK_FILE}"):
        DirectoryLock(str(tmp_path), "training run").acquire()


def test_a_link_planted_at_the_lock_name_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    locked = tmp_path / "dir"
    locked.mkdir()
    os.symlink(target, locked / LOCK_FILE)
    with pytest.raises(DirectoryLocked, match="is a symbolic link"):
        DirectoryLock(str(locked), "training run").acquire()
    assert target.read_text() == "keep"
