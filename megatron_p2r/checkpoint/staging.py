"""Where a converter writes: a staging directory inside DST, moved into place only when complete.

DST is created if missing and locked (``lock.py``) before anything is read or written, for the
whole conversion: a training run cannot start on it, another conversion cannot write it. The
output is staged in ``DST/.p2r-staging-XXXXXXXX``, on DST's own filesystem, and moved in entry by
entry (``publish.py``), so DST itself is never renamed or removed: it may be a mount point.
Whatever a killed conversion left in DST is finished or cleared by the next one.

Nothing live is ever harmed: an existing DST is replaced only with ``force``, never when it
overlaps SRC, and never when a live run holds a lock in it (a ``--save`` inside DST), checked
before anything is done and again before DST's entries are moved away. A failed conversion
removes its output, and DST too when it created it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import tempfile
from typing import Iterator

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import DirectoryLock
from megatron_p2r.checkpoint.naming import REPLACED_TAG, STAGING_TAG
from megatron_p2r.checkpoint.publish import finish_interrupted, publish, refuse_live_runs, user_entries


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def staged_output(src: str, src_iter: str, dst: str, force: bool) -> Iterator[str]:
    """Yield a new, empty staging directory to write into; move it into DST when the block
    completes, remove it when the block raises. DST is checked first: not overlapping SRC (or its
    iteration directory ``src_iter``), not a link, empty unless ``force``, nothing in it in use."""
    _check_destination(src, src_iter, dst)
    _report_earlier_leftovers(dst)
    created = not os.path.lexists(dst)
    os.makedirs(dst, exist_ok=True)
    lock = DirectoryLock(dst, "conversion")
    try:
        lock.acquire()
    except BaseException:
        _remove_if_created(dst, created)
        raise
    try:
        for line in lock.notes + finish_interrupted(dst):
            print(f"{dst}: {line}", flush=True)
        _check_contents(dst, force)
        staging = tempfile.mkdtemp(prefix=STAGING_TAG, dir=dst)
        try:
            yield staging
            publish(staging, dst)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException:
        lock.release()
        _remove_if_created(dst, created)
        raise
    lock.release()


def _remove_if_created(dst: str, created: bool) -> None:
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # only when empty


def _check_destination(src: str, src_iter: str, dst: str) -> None:
    target = os.path.realpath(dst)
    for source in {os.path.realpath(src), os.path.realpath(src_iter)}:
        if _inside(target, source) or _inside(source, target):
            raise CheckpointError(
                f"DST {dst} overlaps SRC {src} (one is inside the other); the converter never "
                "writes into its source and never replaces a directory that holds it"
            )
    if os.path.islink(dst):
        raise CheckpointError(
            f"DST {dst} is a symbolic link; pass the directory it points to "
            f"({os.path.realpath(dst)}) if that is where the result belongs"
        )
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"DST {dst} exists and is not a directory")


def _check_contents(dst: str, force: bool) -> None:
    """DST (locked, with what a killed conversion left finished) is empty, or ``force`` replaces
    what it holds, none of which a live run may hold."""
    if user_entries(dst):
        if not force:
            raise CheckpointError(f"DST {dst} exists and is not empty; pass --force to replace it")
        for name in user_entries(dst):
            refuse_live_runs(os.path.join(dst, name), dst)


def _report_earlier_leftovers(dst: str) -> None:
    """Earlier versions staged beside DST and replaced DST by two renames: a kill between them
    left DST missing and the old one in ``.DST.p2r-replaced-*/old``, restored here; a staging
    directory of theirs may hold a complete result, so it is reported, never removed."""
    parent, base = os.path.split(os.path.abspath(dst))
    for path in sorted(glob.glob(os.path.join(glob.escape(parent), glob.escape("." + base + REPLACED_TAG) + "*"))):
        old = os.path.join(path, "old")
        if not os.path.lexists(dst) and os.path.isdir(old) and not os.path.islink(old):
            os.rename(old, dst)
            with contextlib.suppress(OSError):
                os.rmdir(path)
            print(f"restored {dst} from {old} (a --force conversion was killed while replacing it)", flush=True)
        else:
            print(
                f"note: {path} holds the previous {dst}, replaced by an earlier --force conversion; remove it "
                f"once {dst} is checked: rm -r {shlex.quote(path)}",
                flush=True,
            )
    for path in sorted(glob.glob(os.path.join(glob.escape(parent), glob.escape("." + base + STAGING_TAG) + "*"))):
        print(
            f"note: {path} is the output of an earlier conversion into {dst} that was killed, possibly complete; "
            f"check it with inspect, then use it or remove it: rm -r {shlex.quote(path)}",
            flush=True,
        )
