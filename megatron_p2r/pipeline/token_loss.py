"""The loss side of a step: every schedule's objective and the backward it starts.

The loss is the mean over the global batch's valid tokens, as Megatron-LM and torchtitan
normalise it: sum over every micro-batch of every DP rank of (token loss x loss mask),
divided by the sum of the loss masks over that whole global batch. The stage that computes
the loss counts the valid tokens of its micro-batches before the first forward (the masks
are known up front) and all-reduces that one number over DP (a device tensor: no host
sync). The model returns a micro-batch's masked sum itself when given the loss mask (its
fused loss computes the gradient along: parallel/cross_entropy.py). Each micro-batch's
backward runs on ``masked sum x loss_scale x DP / valid tokens``:
the data-parallel reduction (``parallel/ddp.py``) then averages over DP (and sums the replicas
held by several stages), so the gradient is that of the global token mean whatever the masks
and micro-batch shapes.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_p2r.parallel.state import ParallelState

BackwardScaleHook = Optional[Callable[[float], None]]


def global_valid_tokens(microbatches: List[dict], ps: ParallelState) -> torch.Tensor:
    """Sum of the loss masks of this step's micro-batches over all DP ranks (float64: exact
    counts), at least 1. One all-reduce of a scalar on the device, no host synchronisation."""
    count = torch.zeros((), dtype=torch.float64, device=ps.device)
    for mb in microbatches:
        count += mb["loss_mask"].sum(dtype=torch.float64)
    if ps.group("dp") is not None:
        dist.all_reduce(count, group=ps.group("dp"))
    return count.clamp(min=1.0)


class TokenMeanLoss:
    """The loss side of a step on the stage that computes it: masked sums in, backward on
    their share of the global token mean, this rank's share of the mean out."""

    def __init__(self, microbatches: List[dict], ps: ParallelState, loss_scale: float):
        self.tokens = global_valid_tokens(microbatches, ps)
        # x DP: the data-parallel reduction divides the DP sum of the gradients by DP
        self.grad_factor = (loss_scale * ps.dp_size / self.tokens).float()
        self.total = torch.zeros((), device=ps.device)

    def add(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """This micro-batch's masked sum (the model's output given the loss mask; kept in the
        graph for ``backward``)."""
        self.total.add_(loss_sum.detach().float())
        return loss_sum

    def backward(self, loss_sum: torch.Tensor) -> None:
        (loss_sum * self.grad_factor).backward()

    def share(self) -> torch.Tensor:
        return (self.total / self.tokens).float()


def announce_backward_scale(hook: BackwardScaleHook, loss_scale: float, n: int, forward_only: bool) -> None:
    if hook is not None and not forward_only and n:
        hook(loss_scale / n)
