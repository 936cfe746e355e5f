"""Where a converter writes: a staging directory of its own, renamed to DST only when complete.

The staging directory is created by the converter under a unique name beside DST
(``.DSTNAME.p2r-staging-XXXXXXXX``), never equal to or inside SRC, and holds the converter's
lock (``lock.py``) while it is written, which marks it as the converter's own: a failed
conversion removes it, and one left by a killed converter (its lock free) is removed by the next
conversion into the same DST. Nothing else is ever deleted: an existing DST is replaced only with
``force``, after the new one is complete, and never when it overlaps SRC. DST itself is locked
while the conversion runs, so a training run writing it (or another conversion) refuses, and
this conversion refuses a DST in use.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from typing import Iterator, Optional

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import LOCK_FILE, DirectoryLock, DirectoryLocked

_STAGING_TAG = ".p2r-staging-"
_REPLACED_TAG = ".p2r-replaced-"


def _prefix(dst: str, tag: str) -> str:
    return "." + os.path.basename(os.path.abspath(dst)) + tag


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def staged_output(src: str, src_iter: str, dst: str, force: bool) -> Iterator[str]:
    """Yield a new, empty staging directory to write into; publish it as DST when the block
    completes, remove it when the block raises. DST is checked first: not overlapping SRC (or its
    iteration directory ``src_iter``), not a link, empty unless ``force``, not in use."""
    _check_destination(src, src_iter, dst, force)
    dst_lock = DirectoryLock(dst, "conversion") if os.path.isdir(dst) else None
    with dst_lock or contextlib.nullcontext():
        staging_lock = _make_staging(src, src_iter, dst)
        staging = staging_lock.directory
        try:
            yield staging
            _publish(staging, dst, force)
            staging_lock.moved_to(dst)
        except BaseException:
            staging_lock.release()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        staging_lock.release()


def _check_destination(src: str, src_iter: str, dst: str, force: bool) -> None:
    target = os.path.realpath(dst)
    for source in {os.path.realpath(src), os.path.realpath(src_iter)}:
        if _inside(target, source) or _inside(source, target):
            raise CheckpointError(f"DST {dst} overlaps SRC {src} (one is inside the other); the converter never "
                                  "writes into its source and never replaces a directory that holds it")
    if os.path.islink(dst):
        raise CheckpointError(f"DST {dst} is a symbolic link; pass the directory it points to "
                              f"({os.path.realpath(dst)}) if that is where the result belongs")
    if os.path.lexists(dst) and not force and (not os.path.isdir(dst) or set(os.listdir(dst)) - {LOCK_FILE}):
        raise CheckpointError(f"DST {dst} exists and is not empty; pass --force to replace it")


def _make_staging(src: str, src_iter: str, dst: str) -> DirectoryLock:
    """A new staging directory beside DST, locked (the lock is its mark); stale ones of DST removed."""
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    _remove_stale_stagings(parent, dst)
    staging = tempfile.mkdtemp(prefix=_prefix(dst, _STAGING_TAG), dir=parent)
    real = os.path.realpath(staging)
    if any(_inside(real, os.path.realpath(s)) for s in (src, src_iter)):  # DST's checks exclude it: belt and braces
        os.rmdir(staging)
        raise CheckpointError(f"staging directory {staging} would lie inside SRC {src}")
    lock = DirectoryLock(staging, f"conversion into {os.path.abspath(dst)}")
    lock.acquire()
    return lock


def _remove_stale_stagings(parent: str, dst: str) -> None:
    """Staging directories of DST left by killed conversions: ours (they hold our lock file) and
    free (their converter is gone)."""
    for path in glob.glob(os.path.join(glob.escape(parent), glob.escape(_prefix(dst, _STAGING_TAG)) + "*")):
        if os.path.islink(path) or not os.path.isfile(os.path.join(path, LOCK_FILE)):
            continue  # not made by this tool: left alone
        try:
            with DirectoryLock(path, "clean-up"):
                pass
        except (DirectoryLocked, CheckpointError):
            continue  # still in use, or not provably dead
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {path}: the staging directory of a conversion into {dst} that was killed", flush=True)


def _publish(staging: str, dst: str, force: bool) -> None:
    """Rename the finished staging directory to DST; an existing DST (checked empty, or --force) is
    moved aside first and deleted only once the new one is in place."""
    replaced: Optional[str] = None
    if os.path.lexists(dst):
        if not force and os.path.isdir(dst) and set(os.listdir(dst)) - {LOCK_FILE}:
            raise CheckpointError(f"DST {dst} was filled while converting; pass --force to replace it")
        replaced = tempfile.mkdtemp(prefix=_prefix(dst, _REPLACED_TAG), dir=os.path.dirname(os.path.abspath(dst)))
        os.rename(dst, os.path.join(replaced, "old"))
    try:
        os.rename(staging, dst)
    except OSError as exc:
        if replaced:
            os.rename(os.path.join(replaced, "old"), dst)
            os.rmdir(replaced)
        raise CheckpointError(f"cannot publish {staging} as {dst}: {exc.strerror}") from None
    if replaced:
        shutil.rmtree(replaced)
