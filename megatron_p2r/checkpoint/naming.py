"""Where everything of a checkpoint lives on disk (docs/checkpoint.md): directory, file and tensor names.

A checkpoint of iteration N is ``<dir>/iter_000000N/`` with

    metadata.json                       format version, config, layout, phase, share pattern,
                                        iteration, consumed samples, scheduler, scaler, and
                                        every tensor's global shape / split dims / layer or slot
    mp_rank_TT_PPP_EEE.safetensors      model and optimizer tensors of TP rank TT, stage PPP,
                                        expert-parallel rank EEE
    rng_and_data/rank_RRRRR.safetensors this rank's RNG states and data position

and ``<dir>/latest_checkpointed_iteration.txt`` names the newest complete one.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.files import confined, read_bounded

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
RNG_DIR = "rng_and_data"
# A converter's own entries inside its DST (``publish.py``): its output being written, complete and
# waiting to move in, moving in, and DST's previous entries moved aside.
STAGING_TAG, PUBLISH_TAG = ".p2r-staging-", ".p2r-publish-"
INSTALL_TAG, REPLACED_TAG = ".p2r-install-", ".p2r-replaced-"

_ITER_DIR = re.compile(r"^iter_(\d{7})$", re.ASCII)


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file(tp: int, pp: int, ep: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_{ep:03d}.safetensors"


def shard_header_metadata(name: str) -> Dict[str, int]:
    """The ``__metadata__`` of shard ``name``: format version and its own coordinates."""
    _, _, tp, pp, ep = name.split(".")[0].split("_")
    return {"format_version": FORMAT_VERSION, "tp": int(tp), "pp": int(pp), "ep": int(ep)}


def rng_file(rank: int) -> str:
    return os.path.join(RNG_DIR, f"rank_{rank:05d}.safetensors")


def entry_name(kind: str, key: str) -> str:
    """Name inside a shard: the piece key for weights, ``optimizer.<kind>.<key>`` for moments."""
    return key if kind == "model" else f"optimizer.{kind}.{key}"


def complete_iterations(save_dir: str) -> List[int]:
    """The iterations of ``save_dir`` whose ``iter_N`` directory holds a metadata.json, ascending."""
    return sorted(
        int(m.group(1))
        for d in os.listdir(save_dir)
        if (m := _ITER_DIR.match(d)) and os.path.isfile(os.path.join(save_dir, d, METADATA_FILE))
    )


def resolve_iteration_dir(path: str) -> str:
    """``path`` is a checkpoint directory (with the latest file) or one ``iter_*`` directory; the
    latest file and the iteration directory it names must lie inside ``path`` (not be links out of it)."""
    if os.path.lexists(os.path.join(path, METADATA_FILE)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if not os.path.lexists(latest):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
        if any(name.startswith((PUBLISH_TAG, INSTALL_TAG)) for name in os.listdir(path)):
            raise CheckpointError(
                f"{path}: a conversion into it was killed while moving its result in; rerun that "
                "conversion (or a training run with --save on it) to complete the move"
            )
        raise CheckpointError(f"{path} is not a checkpoint: it has neither {LATEST_FILE} nor {METADATA_FILE}")
    real, root = os.path.realpath(latest), os.path.realpath(path)
    if not real.startswith(root.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"{latest} is a link to {real}, outside {path}; a checkpoint's {LATEST_FILE} "
            "must be its own file (write the iteration number into it)"
        )
    data = read_bounded(latest, CheckpointError, 64)
    try:
        iteration = int(data.decode("utf-8").strip())
        if not 0 <= iteration < 10**7:
            raise ValueError
    except ValueError:  # includes UnicodeDecodeError
        raise CheckpointError(f"{latest}: expected an iteration number, found {data[:40]!r}") from None
    found = confined(path, iteration_dir_name(iteration), CheckpointError, LATEST_FILE)
    if not os.path.lexists(os.path.join(found, METADATA_FILE)):
        raise CheckpointError(f"{latest} names iteration {iteration}, but {found}/{METADATA_FILE} is missing")
    return found
