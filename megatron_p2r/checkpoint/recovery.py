"""Crash recovery of a save directory: undo what a process killed while saving or pruning left
behind, so that every rank of the restarted job reads a consistent directory (docs/reliability.md).

The leftovers are those of ``io.save_checkpoint``: ``iter_N.tmp`` (being written), ``iter_N.old``
(the copy a re-save of the same iteration replaces) and ``iter_N.del`` (being pruned).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.naming import LATEST_FILE, METADATA_FILE, complete_iterations
from megatron_p2r.checkpoint.publish import finish_interrupted

_LEFTOVER = re.compile(r"^iter_(\d{7})\.(tmp|old|del)$", re.ASCII)


def recover_save_dir(save_dir: str) -> List[str]:
    """Repair what a process killed while saving (or pruning) left in ``save_dir``; returns one
    log line per action. Run by one rank before any rank reads the directory.

    * ``iter_N.tmp`` (a save that never finished) and ``iter_N.del`` (a prune that never
      finished) are removed; ``latest`` never names them.
    * ``iter_N.old`` is the previous copy of a checkpoint that was being replaced by a new save
      of the same iteration: it is moved back when the kill struck between the two renames
      (``iter_N`` missing), removed otherwise.
    * stray ``latest_checkpointed_iteration.txt.tmp.*`` files are removed;
    * the output of a conversion into the directory that was killed while moving it in is moved
      in, one killed while writing it removed (``publish.finish_interrupted``);
    * without a ``latest`` file, it is written for the newest complete checkpoint (a kill after
      the first checkpoint was published but before ``latest`` was written).
    """
    if not os.path.isdir(save_dir):
        return []
    actions = finish_interrupted(save_dir)
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        m = _LEFTOVER.match(name)
        if m:
            final = os.path.join(save_dir, f"iter_{m.group(1)}")
            if m.group(2) == "old" and not os.path.lexists(final) and os.path.isfile(os.path.join(path, METADATA_FILE)):
                os.rename(path, final)
                actions.append(f"restored {final} from {name} (a save of the same iteration was interrupted)")
                continue
            _remove(path)
            why = {"tmp": "an interrupted save", "old": "a replaced checkpoint", "del": "an interrupted prune"}
            actions.append(f"removed {path} (left by {why[m.group(2)]})")
        elif name.startswith(LATEST_FILE + ".tmp."):
            _remove(path)
            actions.append(f"removed {path} (left by an interrupted update of {LATEST_FILE})")
    latest = os.path.join(save_dir, LATEST_FILE)
    if not os.path.lexists(latest):
        done = complete_iterations(save_dir)
        if done:
            write_text_atomic(latest, str(done[-1]))
            actions.append(
                f"wrote {latest} = {done[-1]} (the newest complete checkpoint; "
                "a save was interrupted before it was recorded)"
            )
    return actions


def _remove(path: str) -> None:
    """Delete a file, directory or link without following links."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
