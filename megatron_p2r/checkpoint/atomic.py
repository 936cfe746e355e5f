"""Durable writes: a file is seen old or new, never half written, and survives a power cut."""

from __future__ import annotations

import os


def write_text_atomic(path: str, text: str) -> None:
    """Write via a temporary file, fsync, then ``os.replace``: readers see old or new, never half."""
    tmp = f"{path}.tmp.{os.getpid()}"
    if os.path.lexists(tmp):  # never write through a link planted at the temporary name
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make the entries of ``path`` (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
