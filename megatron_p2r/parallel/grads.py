"""Gradient synchronisation after backward, and the global gradient norm.

Per parameter, after the schedule has accumulated this rank's micro-batch gradients:
- replicas held by several pipeline stages (the tied embedding on the first and last stage,
  a pseudo-phase slot used on several stages; attribute ``shared_stages``) are **summed**
  over those stages;
- then averaged over the data-parallel group — expert weights over the expert-dp group.

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
            return ps.stage_subgroup(stages, over="expert_dp"), ps.expert_dp_size
        return ps.group("expert_dp"), ps.expert_dp_size
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
            buckets[(id(group), divisor)].append((group, p))
        elif divisor != 1:
            p.grad.div_(divisor)
    for (_, divisor), members in buckets.items():
        group = members[0][0]
        grads = [p.grad for _, p in members]
        flat = torch.cat([g.reshape(-1) for g in grads])
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


def global_grad_norm(params: List[nn.Parameter], ps: ParallelState) -> float:
    """L2 norm of the whole model's gradient: one scalar all-reduce over the world."""
    owned = [p.grad for p in params if p.grad is not None and counts_for_norm(p, ps)]
    sq = torch.zeros(1, device=ps.device, dtype=torch.float32)
    if owned:
        sq += torch.stack([g.float().pow(2).sum() for g in owned]).sum()
    if dist.is_initialized() and ps.layout.world_size > 1:
        dist.all_reduce(sq)
    return math.sqrt(sq.item())


def clip_grads(params: List[nn.Parameter], max_norm: float, total_norm: float) -> None:
    if max_norm > 0 and total_norm > max_norm and math.isfinite(total_norm):
        coeff = max_norm / (total_norm + 1e-6)
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coeff)
