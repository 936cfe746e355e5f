"""How a converter's finished output replaces DST's contents: entry by entry, inside DST, so
that DST itself is never renamed (it may be a mount point) and a kill at any step is finished by
the next process that locks DST (``finish_interrupted``: a rerun of the converter, or a training
run on it).

The output is written in ``DST/.p2r-staging-X``. When it is complete and verified:

1. it is renamed ``.p2r-publish-X``: the mark that it is whole;
2. DST's previous entries move into ``.p2r-replaced-X``, the latest file first, so that DST never
   names an iteration of the old checkpoint that is half moved away;
3. ``.p2r-publish-X`` is renamed ``.p2r-install-X`` (step 2 is done) and its entries move into
   DST, the latest file last, so that DST names the new checkpoint only once it is all there;
4. ``.p2r-replaced-X`` and the emptied ``.p2r-install-X`` are removed.

Between steps 2 and 3 DST is not loadable (``naming.resolve_iteration_dir`` says why), never a
mix of old and new. A ``.p2r-staging-X`` found by the next holder of the lock is the output of a
conversion killed while writing it, incomplete by construction, and is removed.
"""

from __future__ import annotations

import os
import shutil
from typing import List

from megatron_p2r.checkpoint.atomic import fsync_dir
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import LOCK_FILE, describe, live_holder
from megatron_p2r.checkpoint.naming import INSTALL_TAG, LATEST_FILE, PUBLISH_TAG, REPLACED_TAG, STAGING_TAG

_TAGS = (STAGING_TAG, PUBLISH_TAG, INSTALL_TAG, REPLACED_TAG)


def user_entries(dst: str) -> List[str]:
    """DST's entries that are not the lock's or a converter's own, the latest file first."""
    names = [n for n in os.listdir(dst) if n != LOCK_FILE and not n.startswith(_TAGS)]
    return sorted(names, key=lambda n: (n != LATEST_FILE, n))


class LiveRun(CheckpointError):
    """A directory that would be replaced or removed is held by a live run."""


def refuse_live_runs(root: str, dst: str) -> None:
    """Fail, naming the run, when a live process holds the lock of ``root`` or of any directory
    under it (``root`` is in ``dst``, the conversion's DST): removing it would pull the directory
    from under a run that keeps writing into a deleted inode."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not os.path.islink(os.path.join(directory, d))]
        if LOCK_FILE in files:
            holder = live_holder(directory)
            if holder is not None:
                raise LiveRun(
                    f"{directory} is in use by {describe(holder)}; a --force conversion into {dst} would "
                    "remove it, and the converter never removes a directory a live run writes into "
                    "(wait for the run to finish, or choose another DST)"
                )


def publish(staging: str, dst: str) -> None:
    """Move the complete output ``staging`` (a ``.p2r-staging-X`` of DST) into DST, replacing DST's
    entries, unless a live run holds a directory among them (then ``staging`` is left as it was)."""
    suffix = os.path.basename(staging)[len(STAGING_TAG) :]
    marked = os.path.join(dst, PUBLISH_TAG + suffix)
    os.rename(staging, marked)
    fsync_dir(dst)
    try:
        _finish(dst, suffix)
    except LiveRun:
        if os.path.isdir(marked):  # refused before anything moved: the output is the caller's to remove
            os.rename(marked, staging)
        raise


def _finish(dst: str, suffix: str) -> None:
    """Steps 2-4 for the output ``suffix``, from wherever a killed process left them."""
    marked, install = os.path.join(dst, PUBLISH_TAG + suffix), os.path.join(dst, INSTALL_TAG + suffix)
    replaced = os.path.join(dst, REPLACED_TAG + suffix)
    if os.path.isdir(marked):
        old = user_entries(dst)
        for name in old:
            refuse_live_runs(os.path.join(dst, name), dst)
        os.makedirs(replaced, exist_ok=True)
        for name in old:
            os.rename(os.path.join(dst, name), os.path.join(replaced, name))
        fsync_dir(replaced)
        os.rename(marked, install)
        fsync_dir(dst)
    for name in sorted(os.listdir(install), key=lambda n: (n == LATEST_FILE, n)):
        target = os.path.join(dst, name)
        if os.path.lexists(target):
            raise CheckpointError(
                f"cannot move {os.path.join(install, name)} into {dst}: {target} appeared "
                "meanwhile (another tool writes into DST?); move one of them away and rerun"
            )
        os.rename(os.path.join(install, name), target)
    fsync_dir(dst)
    os.rmdir(install)
    if os.path.isdir(replaced):
        refuse_live_runs(replaced, dst)  # a run started in DST since the check: its directory is kept
        shutil.rmtree(replaced)


def finish_interrupted(dst: str) -> List[str]:
    """Complete or clear what a converter killed while writing into (or publishing to) DST left;
    run while holding DST's lock. Returns one line per action."""
    actions = []
    for name in sorted(os.listdir(dst)):
        path = os.path.join(dst, name)
        if name.startswith((PUBLISH_TAG, INSTALL_TAG)) and os.path.isdir(path):
            _finish(dst, name[len(PUBLISH_TAG if name.startswith(PUBLISH_TAG) else INSTALL_TAG) :])
            actions.append(
                f"completed the move of a finished conversion's output into {dst} (the conversion was "
                "killed while moving it in)"
            )
    for name in sorted(os.listdir(dst)):
        path = os.path.join(dst, name)
        if name.startswith(STAGING_TAG) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            actions.append(f"removed {path}: the incomplete output of a conversion into {dst} that was killed")
        elif name.startswith(REPLACED_TAG) and os.path.isdir(path) and not os.path.islink(path):
            refuse_live_runs(path, dst)
            shutil.rmtree(path)
            actions.append(
                f"removed {path}: the previous contents of {dst}, replaced by a --force conversion "
                "that was killed before removing them"
            )
    return actions
