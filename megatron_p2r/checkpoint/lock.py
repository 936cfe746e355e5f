"""One writer per directory: an exclusive advisory lock that a training run holds on ``--save``
(and a conversion on its DST) for as long as it runs.

The lock is ``DIR/.p2r_lock``, locked with ``flock`` and holding who took it (host, pid, start
time, command) so that a refused run can say who is writing. The kernel releases a ``flock``
when its holder dies, so a lock file whose ``flock`` is free was left by a dead process: on the
same host it is taken over (and said so). A file naming another host is not taken over: a
filesystem shared between machines may not share ``flock`` across them, so that holder may be
alive; the error gives the command that clears it once the user knows it is gone.

Where the filesystem has no ``flock`` at all (Lustre ``-o noflock``), the file's existence is the
lock (``O_EXCL``) and its holder refreshes the file's modification time every ``HEARTBEAT_S``
seconds, since nothing releases the file when the holder dies: a lock whose holder on this host is
no longer running, or whose holder elsewhere has a heartbeat older than ``STALE_AFTER_S``, is
taken over (and said so), which is what ``torchrun --max-restarts`` needs when rank 0 dies.

The file is removed when the lock is released, so a finished run leaves nothing behind.
``live_holder`` asks, without taking anything, whether a live process holds a directory: a
converter asks it of every directory it would replace. A lock file of another ``name`` guards one
file of a directory shared by several processes (offload/nvme.py: each rank's optimizer state).
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
import threading
import time
from typing import List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError

LOCK_FILE = ".p2r_lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
HEARTBEAT_S = 10.0  # without flock: how often the holder touches its lock file
STALE_AFTER_S = 120.0  # without flock: a heartbeat this old means the holder is gone


class DirectoryLocked(CheckpointError):
    """Another live process holds the directory, or a stale lock needs the user's decision."""


def _holder_record(purpose: str) -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "purpose": purpose,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv)[:500],
    }


def _read_holder(fd: int) -> Optional[dict]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe(holder: Optional[dict]) -> str:
    """Who holds a lock, in words, from its record."""
    if not holder:
        return "a process that left no record"
    return (
        f"{holder.get('purpose', 'a process')} (pid {holder.get('pid')} on host {holder.get('host')}, "
        f"started {holder.get('started')}: {holder.get('command')})"
    )


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


def _stale_without_flock(holder: Optional[dict], mtime: float) -> Optional[str]:
    """Why a lock file on a filesystem without flock no longer stands for a live holder, or None.
    A holder on this host is judged by its pid (a stopped process keeps its lock); one elsewhere, or
    one that left no record, by its heartbeat."""
    if holder and holder.get("host") == socket.gethostname():
        return None if _alive(holder.get("pid")) else "which is no longer running"
    age = time.time() - mtime
    if age > STALE_AFTER_S:
        return f"whose heartbeat stopped {age:.0f} s ago (a holder refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


def live_holder(directory: str) -> Optional[dict]:
    """The record of the live process that holds ``directory``'s lock ({} when it left none), or
    None when nobody does; takes nothing. A free lock naming another host counts as held (see
    the module's docstring), a lock file that is not a regular file does not."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        holder = _read_holder(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder or {}
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            return None if _stale_without_flock(holder, st.st_mtime) else holder or {}
        return holder if holder and holder.get("host") != socket.gethostname() else None
    finally:
        os.close(fd)  # drops the shared flock, if taken


class DirectoryLock:
    """``with DirectoryLock(path, purpose):`` or ``acquire()`` / ``release()``; ``notes`` says
    what acquiring did (a stale lock taken over). ``name``: the lock file (another name guards
    ``guards``, a file of the directory, rather than the whole directory)."""

    def __init__(self, directory: str, purpose: str, name: str = LOCK_FILE, guards: Optional[str] = None):
        self.directory, self.purpose, self.guards = directory, purpose, guards or directory
        self.path = os.path.join(directory, name)
        self.fd: Optional[int] = None
        self.notes: List[str] = []
        self._heartbeat: Optional[Tuple[threading.Thread, threading.Event]] = None

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
                raise DirectoryLocked(
                    f"{self.guards} is in use by {describe(holder)}; one "
                    f"{'directory' if self.guards == self.directory else 'file'} takes one writer at a "
                    "time: wait for it to finish, or use another directory"
                ) from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                if os.fstat(fd).st_size == 0 and self._same_file(fd):
                    os.unlink(self.path)  # created by the open above: not a holder's record
                os.close(fd)
                return self._acquire_without_flock()
            if self._same_file(fd):
                return self._take(fd)
            os.close(fd)
        raise DirectoryLocked(f"{self.path} keeps being replaced while locking it; is another tool removing it?")

    def _open(self) -> int:
        """The lock file, created if missing, never through a link planted at its name."""
        try:
            fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DirectoryLocked(
                    f"{self.path} is a symbolic link; remove it (rm {shlex.quote(self.path)})"
                ) from None
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
            raise DirectoryLocked(
                self._stale_message(
                    previous,
                    "the lock names another machine, and a filesystem "
                    "shared between machines may not share locks; if "
                    "that job is no longer running",
                )
            )
        if previous:
            self.notes.append(f"took over the lock of {describe(previous)}, which is no longer running")
        self._write_record(fd)

    def _write_record(self, fd: int) -> None:
        data = json.dumps(_holder_record(self.purpose)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self.fd = fd

    def _acquire_without_flock(self) -> None:
        """No flock on this filesystem: the lock is the file's existence, kept alive by a heartbeat;
        a stale one (``_stale_without_flock``) is moved aside and the lock created anew."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for _ in range(10):
            try:
                fd = os.open(self.path, flags, 0o644)
            except FileExistsError:
                self._take_over_stale_file()
                continue
            self._write_record(fd)
            self._start_heartbeat()
            return
        raise DirectoryLocked(f"{self.path} keeps being replaced while locking it; is another tool removing it?")

    def _take_over_stale_file(self) -> None:
        """Remove the existing lock file if its holder is gone (a note says so), else refuse. It is
        renamed to a name of this process's first, so that of two processes taking over the same
        stale lock only one removes it, and never the other's fresh one."""
        try:
            existing = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return  # released meanwhile: try again
        except OSError as exc:
            raise DirectoryLocked(f"{self.path} cannot be read ({exc.strerror}); remove it") from None
        try:
            holder, st = _read_holder(existing), os.fstat(existing)
        finally:
            os.close(existing)
        why = _stale_without_flock(holder, st.st_mtime)
        if why is None:
            raise DirectoryLocked(
                f"{self.guards} is in use by {describe(holder)}, whose heartbeat is "
                f"{time.time() - st.st_mtime:.0f} s old (this filesystem has no flock: a lock is "
                "stale once its holder on this host has exited, or once a holder elsewhere has "
                f"gone {STALE_AFTER_S:.0f} s without a heartbeat)"
            )
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another process took it over first: try again
        moved = os.stat(aside, follow_symlinks=False)
        if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
            os.rename(aside, self.path)  # a fresh lock created meanwhile: put it back
            return
        os.unlink(aside)
        self.notes.append(f"took over the lock of {describe(holder)}, {why}")

    def _start_heartbeat(self) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._beat, args=(self.fd, stop), name="p2r-lock-heartbeat", daemon=True)
        thread.start()
        self._heartbeat = (thread, stop)

    def _beat(self, fd: int, stop: threading.Event) -> None:
        """Touch the lock file every ``HEARTBEAT_S``. A holder that finds its file gone or replaced
        was paused (SIGSTOP, a frozen VM) past ``STALE_AFTER_S`` and taken over from another host:
        it stops at once, saving nothing, so that two runs never write one directory."""
        while not stop.wait(HEARTBEAT_S):
            if not self._same_file(fd) and not stop.is_set():
                print(
                    f"error: lost the lock on {self.guards}: {self.path} was taken over while this process "
                    f"did not refresh it for over {STALE_AFTER_S:.0f} s (paused?); stopping without writing "
                    "anything more, so that two runs never write one directory (resume from the last checkpoint)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(2)
            try:
                os.utime(fd)
            except OSError:
                pass  # the next beat retries; a lock left without beats is reported as stale, not lost

    def _stale_message(self, holder: dict, why: str) -> str:
        return f"{self.directory} is locked by {describe(holder)}; {why}, clear it with:\n  rm {shlex.quote(self.path)}"

    def release(self) -> None:
        """Remove the lock file (while still holding it), then give up the lock."""
        if self.fd is None:
            return
        if self._heartbeat is not None:  # stopped before its file descriptor is closed
            thread, stop = self._heartbeat
            stop.set()
            thread.join()
            self._heartbeat = None
        if self._same_file(self.fd):
            try:
                os.unlink(self.path)
            except OSError:
                pass  # the directory made read-only meanwhile: the next holder takes the dead holder's file over
        os.close(self.fd)
        self.fd = None
