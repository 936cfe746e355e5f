"""AdamW over the model's fp32 parameters, which are the master weights.

Mixed precision (--bf16/--fp16) runs the forward under ``torch.autocast``: parameters stay
fp32 (4 bytes) and are cast per layer for compute, as torchtitan's FSDP mixed precision does,
instead of keeping bf16 parameters plus a separate fp32 copy. See docs/architecture.md.
Norms and biases (``no_wd``) get no weight decay. With ``--decoupled-lr`` the input embedding
and the output layer get their own peak and final LR (group keys ``max_lr`` / ``min_lr``, which
the scheduler reads), as Megatron-LM's ``is_embedding_or_output_parameter``.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_p2r.config import TrainConfig
from megatron_p2r.layout.tensors import OUTPUT_WEIGHT, WORD_EMBEDDING
from megatron_p2r.parallel.sharding import logical_name


def param_groups(model: nn.Module, t: TrainConfig) -> list:
    groups = {}
    for name, p in model.named_parameters():
        no_wd = getattr(p, "no_wd", False)
        decoupled = t.decoupled_lr is not None and logical_name(name, p) in (WORD_EMBEDDING, OUTPUT_WEIGHT)
        if (no_wd, decoupled) not in groups:
            groups[no_wd, decoupled] = {"params": [], "weight_decay": 0.0 if no_wd else t.weight_decay}
            if decoupled:
                groups[no_wd, decoupled].update(max_lr=t.decoupled_lr, min_lr=t.decoupled_min_lr
                                                if t.decoupled_min_lr is not None else t.min_lr)
        groups[no_wd, decoupled]["params"].append(p)
    return [groups[key] for key in sorted(groups)]


def build_optimizer(model: nn.Module, t: TrainConfig, params=None) -> torch.optim.AdamW:
    """torch's fused AdamW (foreach where fused is unavailable)."""
    groups = param_groups(model, t) if params is None else params
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
