"""The ranks of the lane's multi-rank tests (tests/cuda/test_multirank.py), in a module of their
own: a spawned rank imports it without the test module's skip."""

from __future__ import annotations

import os

import torch

from megatron_p2r.arguments import config_from_values
from megatron_p2r.training import resolve_device, setup_parallel
from tests.helpers import TINY, keep_first_step_grads, run_steps


def train_rank(rank: int, world: int, values: dict, steps: int, one_gpu: bool) -> dict:
    """Join through ``pretrain``'s own path (``resolve_device`` + ``setup_parallel``: validation,
    the memory preflight, the groups) and train ``steps``: losses, and this rank's first-step
    gradients on CPU. ``one_gpu``: every rank on device 0 (gloo over CUDA tensors)."""
    if one_gpu:
        os.environ["LOCAL_RANK"] = "0"
    cfg = config_from_values({**TINY, **values, "device": "cuda"})
    device = resolve_device(cfg)
    ps, _ = setup_parallel(cfg, device)
    grads: dict = {}
    losses, _ = run_steps(cfg, ps, steps, after_step=keep_first_step_grads(grads))
    return {
        "losses": losses,
        "grads": {n: g.to("cpu", torch.float64) for n, g in grads.items()},
        "device": str(device),
        "backend": torch.distributed.get_backend(),
    }
