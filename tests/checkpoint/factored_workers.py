"""What each spawned rank runs for the factored-statistics tests (no pytest import: ranks start
faster): Adafactor on TP2 and on DP2 with the distributed optimizer (matrices cut between the
ranks' shards), saved fully parallel and with one writer, then loaded into a fresh state."""

from __future__ import annotations

import os

import torch

from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.training import build_train_state, setup_parallel
from tests.checkpoint.common import cfg_of
from tests.helpers import run_steps

CASES = {
    "tp2": dict(tensor_model_parallel_size=2),
    "dp2-distopt": dict(use_distributed_optimizer=True, global_batch_size=8),
}
FLAGS = dict(optimizer="adafactor")


def _statistics(state) -> dict:
    """(parameter, first element stepped) -> this rank's optimizer state of that range."""
    opt = state.optimizer
    return {
        (ms.name, ms.start): {k: v.clone() for k, v in opt.inner[ms.placement].state[ms.main].items()}
        for ms in opt.shards
    }


def save_and_load(rank: int, world: int, root: str) -> dict:
    """Per case: 2 steps, saved both ways, each loaded into a fresh state: whether every
    statistic came back bitwise, whether a matrix was cut between ranks, and the losses of 2 steps
    resumed from the saved state and from the straight run."""
    out = {}
    for name, flags in CASES.items():
        c = cfg_of(**FLAGS, **flags)
        ps, _ = setup_parallel(c, torch.device("cpu"))
        saved = {}

        def save(state, name=name, flags=flags, c=c) -> None:
            if state.iteration == 2:
                save_checkpoint(os.path.join(root, name, "par"), state)
                state.cfg = cfg_of(ckpt_fully_parallel_save=False, **FLAGS, **flags)
                save_checkpoint(os.path.join(root, name, "single"), state)
                state.cfg = c
                saved.update(_statistics(state))

        straight, state = run_steps(c, ps, 4, after_step=save)
        cut = any(not ms.whole and ms.param.dim() >= 2 for ms in state.optimizer.shards)
        same = {}
        for how in ("par", "single"):
            fresh = build_train_state(c, ps)
            load_checkpoint(os.path.join(root, name, how), fresh)
            loaded = _statistics(fresh)
            same[how] = loaded.keys() == saved.keys() and all(
                loaded[k].keys() == saved[k].keys() and all(torch.equal(loaded[k][s], saved[k][s]) for s in saved[k])
                for k in saved
            )
        resumed, _ = run_steps(c, ps, 2, load=os.path.join(root, name, "par"))
        out[name] = {"same": same, "cut": cut, "straight": straight, "resumed": resumed}
    return out
