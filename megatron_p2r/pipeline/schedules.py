"""Forward/backward schedules over the micro-batches of one optimizer step.

All schedules compute the same gradients: each micro-batch's loss is the masked mean over
its tokens, scaled by ``loss_scale / num_microbatches`` before backward, so accumulated
gradients are those of the mean loss (averaged over DP afterwards by ``finalize_grads``).
``get_forward_backward_func`` picks no-pipelining for PP=1, else GPipe or 1F1B.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from megatron_p2r.moe import aux_loss
from megatron_p2r.parallel.state import ParallelState


def masked_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(token_loss.dtype)
    return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def autocast_context(ps: ParallelState, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=ps.device.type, dtype=dtype)


def forward_backward_no_pipelining(model, microbatches: List[dict], ps: ParallelState, *,
                                   loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                                   forward_only: bool = False) -> torch.Tensor:
    """Gradient accumulation on one stage; returns the mean loss over micro-batches (detached)."""
    n = len(microbatches)
    aux_loss.set_backward_scale(loss_scale / n)
    total = torch.zeros((), device=ps.device)
    for mb in microbatches:
        with autocast_context(ps, dtype), (torch.no_grad() if forward_only else contextlib.nullcontext()):
            loss = masked_mean(model(tokens=mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
        if not forward_only:
            (loss * (loss_scale / n)).backward()
        total += loss.detach().float()
    return total / n


def get_forward_backward_func(ps: ParallelState, schedule: str = "1f1b") -> Callable:
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    from megatron_p2r.pipeline import pipelined
    return pipelined.SCHEDULES[schedule]
