"""Normalisation layers: torch's LayerNorm / RMSNorm over the hidden size (the layer norms) or
over one head's dimension (--qk-layernorm, --qk-l2-norm); an RMSNorm over all heads of a projection
(--qk-layernorm-over-heads, OLMo 2). NVIDIA apex's fused kernels are not needed for these sizes."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.parallel.mappings import copy_to_region, reduce_from_region
from megatron_p2r.parallel.sharding import make_param


def make_norm(cfg: ModelConfig, device=None, size: Optional[int] = None) -> nn.Module:
    """--normalization over the last ``size`` (default hidden size) features, weight 1, bias 0."""
    cls = nn.LayerNorm if cfg.normalization == "LayerNorm" else nn.RMSNorm
    norm = cls(size or cfg.hidden_size, eps=cfg.norm_epsilon, device=device)
    for name, p in norm.named_parameters():
        p.tp_dim, p.expert, p.no_wd = None, False, True
        p.init = ("ones",) if name == "weight" else ("zeros",)
    return norm


class HeadsRMSNorm(nn.Module):
    """RMSNorm of each token over all heads of a projection, ``x [b, heads, s, d]`` (this rank's
    ``heads`` of them under TP), with a weight per (head, dimension) split as the heads.

    The mean square of a token is the sum of squares over this rank's heads, all-reduced over
    TP (its gradient all-reduced too: every rank's outputs depend on every rank's heads), divided by TP x local size: also
    right with key/value heads replicated over TP/groups ranks, where each head is counted
    TP/groups times. The ops are torch's RMSNorm's (fp32 upcast, rstd, x * rstd times the
    weight), so it saves what the planner counts for one (``planning.activations``)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp_group, tp_size: int, tp_replicas: int, device=None):
        super().__init__()
        self.heads, self.eps, self.group, self.tp_size = heads, eps, tp_group, tp_size
        self.weight = make_param(
            (heads * head_dim,), tp_dim=0, init=("ones",), no_wd=True, tp_replicas=tp_replicas, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.transpose(1, 2).float()  # [b, s, heads, d]: each token's heads side by side, as x is laid out
        square_sum = x32.pow(2).sum(dim=(2, 3), keepdim=True)  # [b, s, 1, 1]
        if self.tp_size > 1:
            square_sum = reduce_from_region(copy_to_region(square_sum, self.group), self.group)
        rstd = torch.rsqrt(square_sum / (x.shape[1] * x.shape[3] * self.tp_size) + self.eps)
        # contiguous per head, as torch's RMSNorm leaves a per-head norm's output (planning.activations)
        return (x32 * rstd * self.weight.view(self.heads, -1)).to(x.dtype).transpose(1, 2).contiguous()


def make_qk_norm(cfg: ModelConfig, device=None) -> Optional[nn.Module]:
    """The query/key heads' norm: --qk-layernorm's (weights over the head dimension), --qk-l2-norm's
    (an RMSNorm without weights: x / sqrt(mean(x^2) + eps), which torch computes in fp32 for 16-bit
    inputs, as megatron-core's L2Norm does), or None."""
    if cfg.qk_l2_norm:
        return nn.RMSNorm(cfg.head_dim, eps=cfg.norm_epsilon, elementwise_affine=False, device=device)
    return make_norm(cfg, device, cfg.head_dim) if cfg.qk_layernorm else None
