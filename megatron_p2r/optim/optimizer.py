"""AdamW over the model's fp32 parameters, which are the master weights.

Mixed precision (--bf16/--fp16) runs the forward under ``torch.autocast``: parameters stay
fp32 (4 bytes) and are cast per layer for compute, as torchtitan's FSDP mixed precision does,
instead of keeping bf16 parameters plus a separate fp32 copy. See docs/architecture.md.
Norms and biases (``no_wd``) get no weight decay.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_p2r.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list:
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if getattr(p, "no_wd", False) else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(model: nn.Module, t: TrainConfig, params=None) -> torch.optim.AdamW:
    """torch's fused AdamW (foreach where fused is unavailable)."""
    groups = param_groups(model, t.weight_decay) if params is None else params
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
