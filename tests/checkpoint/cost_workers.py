"""What each spawned rank runs for the checkpoint-cost test (no pytest import: ranks start
faster): one step, then the same state saved fully parallel and with one writer, and the host
copy an asynchronous save would take of it."""

from __future__ import annotations

import os

import torch

from megatron_p2r.checkpoint import async_save
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.training import setup_parallel
from tests.checkpoint.common import cfg_of
from tests.helpers import run_steps


def held_bytes(tensors) -> int:
    """Bytes of host memory ``tensors`` hold: each distinct storage once, whole."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def save_both_ways(rank: int, world: int, root: str, cases: dict) -> dict:
    """For each case (flags): 1 step, then save under ``root/<case>/par`` and ``root/<case>/single``;
    returns {case: bytes of the host copy ``--async-save`` takes on this rank}."""
    copied = {}
    for name, flags in cases.items():
        c = cfg_of(global_batch_size=8, **flags)
        ps, _ = setup_parallel(c, torch.device("cpu"))

        def save(state, name=name, flags=flags, c=c) -> None:
            save_checkpoint(os.path.join(root, name, "par"), state)
            state.cfg = cfg_of(global_batch_size=8, ckpt_fully_parallel_save=False, **flags)
            save_checkpoint(os.path.join(root, name, "single"), state)
            state.cfg = c
            copied[name] = held_bytes(t for _, _, t in async_save.host_copy(async_save.owned_state(state, True)))

        run_steps(c, ps, 1, after_step=save)
    return copied
