"""Normalisation layers: torch's LayerNorm / RMSNorm over the hidden size (the layer norms) or
over one head's dimension (--qk-layernorm, --qk-l2-norm). NVIDIA apex's fused kernels are not needed for
these sizes."""

from __future__ import annotations

from typing import Optional

from torch import nn

from megatron_p2r.config import ModelConfig


def make_norm(cfg: ModelConfig, device=None, size: Optional[int] = None) -> nn.Module:
    """--normalization over the last ``size`` (default hidden size) features, weight 1, bias 0."""
    cls = nn.LayerNorm if cfg.normalization == "LayerNorm" else nn.RMSNorm
    norm = cls(size or cfg.hidden_size, eps=cfg.norm_epsilon, device=device)
    for name, p in norm.named_parameters():
        p.tp_dim, p.expert, p.no_wd = None, False, True
        p.init = ("ones",) if name == "weight" else ("zeros",)
    return norm


def make_qk_norm(cfg: ModelConfig, device=None) -> Optional[nn.Module]:
    """The query/key heads' norm: --qk-layernorm's (weights over the head dimension), --qk-l2-norm's
    (an RMSNorm without weights: x / sqrt(mean(x^2) + eps), which torch computes in fp32 for 16-bit
    inputs, as megatron-core's L2Norm does), or None."""
    if cfg.qk_l2_norm:
        return nn.RMSNorm(cfg.head_dim, eps=cfg.norm_epsilon, elementwise_affine=False, device=device)
    return make_norm(cfg, device, cfg.head_dim) if cfg.qk_layernorm else None
