"""One writer per directory: an exclusive advisory lock that a training run holds on ``--save``
(and a conversion on its DST) for as long as it runs.

The lock is ``DIR/.p2r_lock``, locked with ``flock`` and holding who took it (host, pid, start
time, command) so that a refused run can say who is writing. The kernel releases a ``flock``
when its holder dies, so a lock file whose ``flock`` is free was left by a dead process: on the
same host it is taken over (and said so). A file naming another host is not taken over: a
filesystem shared between machines may not share ``flock`` across them, so that holder may be
alive; the error gives the command that clears it once the user knows it is gone. Where the
filesystem has no ``flock`` at all, the file's existence is the lock (``O_EXCL``): a holder on
this host that is no longer running is reported as stale with the same command.

The file is removed when the lock is released, so a finished run leaves nothing behind.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
from typing import List, Optional

from megatron_p2r.checkpoint.errors import CheckpointError

LOCK_FILE = ".p2r_lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class DirectoryLocked(CheckpointError):
    """Another live process holds the directory, or a stale lock needs the user's decision."""


def _holder_record(purpose: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in sys.argv)[:500]}


def _read_holder(fd: int) -> Optional[dict]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: Optional[dict]) -> str:
    if not holder:
        return "a process that left no record"
    return (f"{holder.get('purpose', 'a process')} (pid {holder.get('pid')} on host {holder.get('host')}, "
            f"started {holder.get('started')}: {holder.get('command')})")


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirectoryLock:
    """``with DirectoryLock(path, purpose):`` or ``acquire()`` / ``release()``; ``notes`` says
    what acquiring did (a stale lock taken over)."""

    def __init__(self, directory: str, purpose: str):
        self.directory, self.purpose = directory, purpose
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd: Optional[int] = None
        self.notes: List[str] = []

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        for _ in range(10):  # retried only when the file was replaced between open and flock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DirectoryLocked(f"{self.directory} is in use by {_describe(holder)}; one directory takes one "
                                      "writer at a time: wait for it to finish, or use another directory") from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                if os.fstat(fd).st_size == 0 and self._same_file(fd):
                    os.unlink(self.path)  # created by the open above: not a holder's record
                os.close(fd)
                return self._acquire_exclusive_file()
            if self._same_file(fd):
                return self._take(fd)
            os.close(fd)
        raise DirectoryLocked(f"{self.path} keeps being replaced while locking it; is another tool removing it?")

    def _open(self) -> int:
        """The lock file, created if missing, never through a link planted at its name."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DirectoryLocked(f"{self.path} is a symbolic link; remove it "
                                      f"(rm {shlex.quote(self.path)})") from None
            raise CheckpointError(f"cannot lock {self.directory}: {exc.strerror} ({self.path})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DirectoryLocked(f"{self.path} is not a regular file; remove it")
        return fd

    def _same_file(self, fd: int) -> bool:
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def _take(self, fd: int) -> None:
        """The flock is ours: the record in the file, if any, is of a process that is gone."""
        previous = _read_holder(fd)
        if previous and previous.get("host") != socket.gethostname():
            os.close(fd)
            raise DirectoryLocked(self._stale_message(previous, "the lock names another machine, and a filesystem "
                                                                "shared between machines may not share locks; if "
                                                                "that job is no longer running"))
        if previous:
            self.notes.append(f"took over the lock of {_describe(previous)}, which is no longer running")
        self._write_record(fd)

    def _write_record(self, fd: int) -> None:
        data = json.dumps(_holder_record(self.purpose)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self.fd = fd

    def _acquire_exclusive_file(self) -> None:
        """No flock on this filesystem: the lock is the file's existence."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            existing = self._open()
            holder = _read_holder(existing)
            os.close(existing)
            if holder and holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
                raise DirectoryLocked(self._stale_message(holder, "that process is no longer running (stale lock); "
                                                                  "if no other job uses the directory")) from None
            raise DirectoryLocked(f"{self.directory} is in use by {_describe(holder)} (this filesystem has no flock, "
                                  f"so a crashed holder's lock stays: if it is gone, rm "
                                  f"{shlex.quote(self.path)})") from None
        self._write_record(fd)

    def _stale_message(self, holder: dict, why: str) -> str:
        return (f"{self.directory} is locked by {_describe(holder)}; {why}, clear it with:\n  rm "
                f"{shlex.quote(self.path)}")

    def moved_to(self, directory: str) -> None:
        """The locked directory was renamed to ``directory`` (a published staging directory)."""
        self.directory, self.path = directory, os.path.join(directory, LOCK_FILE)

    def release(self) -> None:
        """Remove the lock file (while still holding it), then give up the lock."""
        if self.fd is None:
            return
        if self._same_file(self.fd):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None
