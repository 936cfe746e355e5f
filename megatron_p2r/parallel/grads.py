"""The global gradient norm, clipping, and the reduction each gradient needs.

Training reduces gradients through ``parallel/ddp.py`` (buffers, buckets, overlap), as the
``ParallelPlan``'s ``Reduction`` of each parameter says (``reduction_of``):
- replicas held by several pipeline stages (the tied embedding on the first and last stage,
  a pseudo-phase slot used on several stages) are **summed** over those stages;
- then averaged over the data-parallel group — expert weights all-reduced over the expert-dp
  group but divided by the whole DP size: with EP, an expert's owner already holds the sum of
  the gradients its EP peers' tokens sent it, so the mean over all DP ranks' losses is
  (sum over expert-dp) / DP, not / expert-DP (docs/moe.md).
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron_p2r.layout.plan import ParallelPlan, Reduction
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import ParallelState


def reduction_of(plan: ParallelPlan, name: str, p: nn.Parameter) -> Reduction:
    """The plan's reduction of parameter ``name`` (its module path)."""
    return plan.reduction(logical_name(name, p), getattr(p, "expert", False))


def grad_norm_and_non_finite(
    grads: Sequence[torch.Tensor], owned: Sequence[bool], ps: ParallelState
) -> Tuple[float, bool]:
    """(global L2 norm of the gradient, whether any rank has an inf/nan in it).

    ``grads`` are the gradients this rank's optimizer steps (whole tensors, or shards under the
    distributed optimizer), ``owned`` whether each counts in the norm (the plan's
    ``counts_in_norm``: each logical element exactly once). One ``_foreach_norm`` and one
    all-reduce of two scalars — the sum of squares of the owned gradients and a non-finite flag
    — so every rank takes the same skip decision. A non-finite value anywhere makes its
    tensor's norm non-finite.
    """
    stats = torch.zeros(2, device=ps.device, dtype=torch.float32)
    if len(grads):
        # in fp32 whatever the gradients' dtype: a bf16 norm per tensor would keep 3 digits
        norms = torch.stack([n.to(stats.device) for n in torch._foreach_norm(list(grads), dtype=torch.float32)])
        stats[0] = norms[torch.tensor(list(owned), device=norms.device)].pow(2).sum()
        stats[1] = (~torch.isfinite(norms)).any().float()
    if ps.layout.world_size > 1:
        dist.all_reduce(stats)
    norm = math.sqrt(stats[0].item())
    return norm, bool(stats[1].item() > 0) or not math.isfinite(norm)


def clip_coefficient(total_norm: float, loss_scale: float, max_norm: float) -> float:
    """What to multiply the gradients by to unscale them and clip them to ``max_norm`` (of the unscaled norm)."""
    coeff = 1.0 / loss_scale
    norm = total_norm / loss_scale
    if max_norm > 0 and norm > max_norm:
        coeff *= max_norm / (norm + 1e-6)
    return coeff


def unscale_and_clip(grads: Sequence[torch.Tensor], total_norm: float, loss_scale: float, max_norm: float) -> None:
    """Divide by the loss scale and clip to ``max_norm`` (of the unscaled norm) in one pass."""
    coeff = clip_coefficient(total_norm, loss_scale, max_norm)
    if coeff != 1.0 and len(grads):
        torch._foreach_mul_(list(grads), coeff)
