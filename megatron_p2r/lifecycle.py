"""What a run takes at its start and gives back at its end: the lock on ``--save`` and the
process groups.

``lock_save_dir``: rank 0 locks ``--save`` (``checkpoint/lock.py``) before anything reads or
repairs it, and every rank learns the outcome, so a second run on the same directory stops at
once on every rank (rank 0 says who holds it) instead of two runs overwriting each other's
iterations. ``shutdown`` ends a run cleanly on every path: the lock released, pending
point-to-point work waited for, and every process group destroyed in order while all ranks are
still alive (see docs/reliability.md for the abort at exit this prevents).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import DirectoryLock
from megatron_p2r.config import Config
from megatron_p2r.parallel.state import ParallelState


def lock_save_dir(cfg: Config, ps: ParallelState) -> Optional[DirectoryLock]:
    """Rank 0's lock on --save (None elsewhere, and without --save); an error on every rank when
    another run holds it."""
    save = cfg.checkpoint.save
    if not save:
        return None
    lock, failure = None, None
    if ps.rank == 0:
        os.makedirs(save, exist_ok=True)
        lock = DirectoryLock(save, "training run")
        try:
            lock.acquire()
        except CheckpointError as exc:
            failure = exc
        for note in lock.notes:
            print(f"--save {save}: {note}", flush=True)
    refused = torch.tensor([1.0 if failure else 0.0], device=ps.device)
    if ps.layout.world_size > 1:
        dist.all_reduce(refused, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if refused.item():
        raise CheckpointError(f"--save {save} is in use by another run (rank 0 says which)")
    return lock
