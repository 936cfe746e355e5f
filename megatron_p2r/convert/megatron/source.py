"""Where a Megatron-LM checkpoint is and which layout it has.

SRC is a ``--save`` directory (``latest_checkpointed_iteration.txt`` names an iteration, or
``release``) or one iteration directory. An iteration directory with a dist_checkpointing
``metadata.json`` is torch_dist; one with ``mp_rank_*`` directories is the legacy layout.
"""

from __future__ import annotations

import os
from typing import Union

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.dist import CONFIG_FILE, DCP_METADATA, DistCheckpoint
from megatron_p2r.convert.megatron.legacy import RANK_DIR, LegacyCheckpoint

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MegatronCheckpoint = Union[LegacyCheckpoint, DistCheckpoint]


def _is_iteration_dir(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, CONFIG_FILE))
        or os.path.isfile(os.path.join(path, DCP_METADATA))
        or any(RANK_DIR.fullmatch(d) for d in os.listdir(path))
    )


def megatron_iteration_dir(path: str) -> str:
    """The iteration directory SRC names (megatron/training/checkpointing.py: read_metadata)."""
    if _is_iteration_dir(path):
        return path
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
        raise CheckpointError(
            f"{path} is not a Megatron-LM checkpoint: it has no {TRACKER_FILE}, no mp_rank_* "
            f"directories and no {CONFIG_FILE}"
        )
    with open(tracker, "rb") as fh:
        text = fh.read(64).decode("utf-8", "replace").strip()
    if text == "release":
        found = os.path.join(path, "release")
    elif text.isascii() and text.isdigit():
        found = os.path.join(path, f"iter_{int(text):07d}")
    else:
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
    if not _is_iteration_dir(found):
        raise CheckpointError(
            f"{tracker} names {os.path.basename(found)}, but {found} holds no mp_rank_* "
            f"directories and no {CONFIG_FILE}"
        )
    return found


def open_megatron(path: str) -> MegatronCheckpoint:
    """The checkpoint SRC names, in whichever layout it was saved."""
    iter_dir = megatron_iteration_dir(path)
    if os.path.isfile(os.path.join(iter_dir, CONFIG_FILE)):
        return DistCheckpoint(iter_dir)
    if os.path.isfile(os.path.join(iter_dir, DCP_METADATA)):
        raise CheckpointError(
            f"{iter_dir}: a {DCP_METADATA} without {CONFIG_FILE} (--ckpt-format torch_dcp or "
            "fsdp_dtensor) is not read; save with --ckpt-format torch_dist or torch"
        )
    return LegacyCheckpoint(iter_dir)
