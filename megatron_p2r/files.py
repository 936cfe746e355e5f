"""Opening files that other files name, and files a user points at, without surprises.

A shard listed in ``metadata.json``, a weight file in an HF index or a cached dataset index is
named by a file that may have been edited by hand or crafted: the name is resolved and must stay
inside its directory (no ``../`` or absolute name, no link out of it), and only a regular file is
opened, so a FIFO (which would block ``open`` forever), a device or a directory in its place is
an error naming it. JSON and YAML read through here are bounded in size, and a key that appears
twice is an error rather than silently the last one.

Every function takes the exception type to raise, so each caller keeps its own error type
(``CheckpointError``, ``ConfigError``, ...) and its entry point reports it as one line.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Callable, Type

MiB = 2**20
JSON_LIMIT = 1024 * MiB  # metadata.json of a 10T MoE checkpoint is ~200 MB; anything beyond is not ours


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def confined(root: str, name, error: Type[Exception], what: str) -> str:
    """``root/name``, after checking that ``name`` (read from a file; ``what`` says which field)
    is a relative name that, links resolved, stays inside ``root``."""
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name):
        raise error(f"{what}: {name!r} is not a file name relative to {root}")
    base = os.path.realpath(root)
    resolved = os.path.realpath(os.path.join(base, name))
    if not resolved.startswith(base.rstrip(os.sep) + os.sep):
        raise error(
            f"{what}: {name!r} resolves to {resolved}, outside {root}; files named by a file must lie in its directory"
        )
    return os.path.join(root, name)


def check_regular(path: str, error: Type[Exception], what: str = "") -> int:
    """The size of ``path``; an error unless it is a regular file (links followed).
    FileNotFoundError propagates, so callers keep their own 'missing' message."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what + ': ' if what else ''}{path} is {_kind(st.st_mode)}, expected a regular file")
    return st.st_size


def open_regular(path: str, error: Type[Exception], what: str = "", mode: str = "rb", encoding=None):
    """Open ``path`` for reading; an error unless it is a regular file. The open itself does not
    block (O_NONBLOCK), so a FIFO is refused instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what + ': ' if what else ''}{path} is {_kind(st.st_mode)}, expected a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str, error: Type[Exception], limit: int, what: str = "") -> bytes:
    """The bytes of the regular file ``path``; an error when it holds more than ``limit``."""
    with open_regular(path, error, what) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise error(
            f"{what + ': ' if what else ''}{path} is larger than {limit:,} bytes; "
            "this is not a file this project writes"
        )
    return data


def unique_keys(error: Type[Exception], where: str) -> Callable:
    """A json ``object_pairs_hook`` that refuses a key appearing twice in one object."""

    def hook(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{where}: key {key!r} appears twice in one object")
            out[key] = value
        return out

    return hook


def read_json(path: str, error: Type[Exception], limit: int = JSON_LIMIT):
    """Parse the JSON file ``path`` (regular, at most ``limit`` bytes, unique keys, bounded nesting,
    no NaN or Infinity, which are not JSON). FileNotFoundError propagates."""
    return parse_json(read_bounded(path, error, limit), path, error)


def parse_json(data: bytes, path: str, error: Type[Exception]):
    """``read_json`` of bytes already read from ``path`` (to check them before parsing too)."""

    def no_constant(name):
        raise error(f"{path}: {name} is not a JSON number")

    try:
        return json.loads(data, object_pairs_hook=unique_keys(error, path), parse_constant=no_constant)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(exc, error):
            raise
        raise error(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
