"""Gradient synchronisation after backward, and the global gradient norm.

Per parameter, after the schedule has accumulated this rank's micro-batch gradients:
- replicas held by several pipeline stages (the tied embedding on the first and last stage,
  a pseudo-phase slot used on several stages; attribute ``shared_stages``) are **summed**
  over those stages;
- then averaged over the data-parallel group — expert weights all-reduced over the expert-dp
  group but divided by the whole DP size: with EP, an expert's owner already holds the sum of
  the gradients its EP peers' tokens sent it, so the mean over all DP ranks' losses is
  (sum over expert-dp) / DP, not / expert-DP (docs/moe.md).

Both reductions are linear, so they are fused where they can be: a replica shared by the
stages S is reduced with *one* all-reduce over the group S x dp (then divided by dp), and
every parameter with the same group goes into one flat bucket (one collective per group).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron_p2r.parallel.state import ParallelState


def sync_group(p: nn.Parameter, ps: ParallelState) -> Tuple[Optional[dist.ProcessGroup], int]:
    """(group to all-reduce over, divisor) for one parameter."""
    stages = getattr(p, "shared_stages", None)
    if getattr(p, "expert", False):
        if stages:
            return ps.stage_subgroup(stages, over="expert_dp"), ps.dp_size
        return ps.group("expert_dp"), ps.dp_size
    if stages:
        return ps.stage_subgroup(stages, over="dp"), ps.dp_size
    return ps.group("dp"), ps.dp_size


def finalize_grads(params: Iterable[nn.Parameter], ps: ParallelState) -> None:
    """Sum replicas over stages and average over data parallelism, one bucket per group."""
    buckets = defaultdict(list)
    for p in params:
        if p.grad is None:  # e.g. an expert that received no token: still join the collective
            p.grad = torch.zeros_like(p)
        group, divisor = sync_group(p, ps)
        if group is not None:
            buckets[(id(group), divisor, p.grad.device)].append((group, p))
        elif divisor != 1:
            p.grad.div_(divisor)
    for (_, divisor, _), members in buckets.items():
        group = members[0][0]
        grads = [p.grad for _, p in members]
        # host-resident (offloaded) gradients travel through the device: NCCL reduces device tensors
        flat = torch.cat([g.reshape(-1) for g in grads]).to(ps.device)
        dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def counts_for_norm(p: nn.Parameter, ps: ParallelState) -> bool:
    """Whether this rank's copy of ``p`` is the one that counts in the global norm.

    Every logical element must be counted exactly once: replicated-over-TP tensors on TP rank
    0 only, stage replicas on their first stage only, data-parallel replicas on dp (or
    expert-dp) rank 0 only.
    """
    if getattr(p, "tp_dim", None) is None and ps.tp_rank != 0:
        return False
    stages = getattr(p, "shared_stages", None)
    if stages and ps.pp_rank != min(stages):
        return False
    return (ps.expert_dp_rank if getattr(p, "expert", False) else ps.dp_rank) == 0


def grad_norm_and_non_finite(params: List[nn.Parameter], ps: ParallelState) -> Tuple[float, bool]:
    """(global L2 norm of the gradient, whether any rank has an inf/nan in it).

    One ``_foreach_norm`` over local gradients and one all-reduce of two scalars: the sum of
    squares of the owned gradients and a non-finite flag, so every rank takes the same
    skip decision. A non-finite value anywhere makes its tensor's norm non-finite.
    """
    grads = [p.grad for p in params if p.grad is not None]
    stats = torch.zeros(2, device=ps.device, dtype=torch.float32)
    if grads:
        norms = torch.stack([n.to(stats.device) for n in torch._foreach_norm(grads)]).float()  # host grads too
        owned = torch.tensor([counts_for_norm(p, ps) for p in params if p.grad is not None], device=norms.device)
        stats[0] = norms[owned].pow(2).sum()
        stats[1] = (~torch.isfinite(norms)).any().float()
    if ps.layout.world_size > 1:
        dist.all_reduce(stats)
    norm = math.sqrt(stats[0].item())
    return norm, bool(stats[1].item() > 0) or not math.isfinite(norm)


def unscale_and_clip(params: List[nn.Parameter], total_norm: float, loss_scale: float, max_norm: float) -> None:
    """Divide by the loss scale and clip to ``max_norm`` (of the unscaled norm) in one pass."""
    coeff = 1.0 / loss_scale
    norm = total_norm / loss_scale
    if max_norm > 0 and norm > max_norm:
        coeff *= max_norm / (norm + 1e-6)
    if coeff != 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coeff)
