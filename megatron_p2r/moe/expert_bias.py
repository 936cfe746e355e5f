"""Auxiliary-loss-free load balancing (DeepSeek-V3; Megatron-LM's ``--moe-router-enable-expert-bias``).

Each MoE router holds a per-expert bias (fp32 buffer ``expert_bias``, no gradient, no optimizer
state) that is added to the sigmoid scores to choose the experts, never to their weights
(``moe/router.py``). After each step's backward every bias moves by ``--moe-router-bias-update-rate``
towards balance: up for an expert that got fewer assignments than the mean, down for one that got
more, by the *sign* of the error only. The routers are the decoder's MoE layers' and, with
``--mtp-num-layers``, those of MoE multi-token prediction depths (on the last stage), as Megatron-LM
updates every router of the model.

Counting: each MoE call adds its assignments per expert (kept ones, after capacity drops, as
Megatron-LM counts them) to the router's ``tokens_per_expert`` when the backward of its routed
rows runs: once per micro-batch and layer, also under activation recomputation (whose second
forward has no backward of its own) and never in evaluation. The update sums the counts over
every rank that routes tokens of the same router (tensor and data parallel ranks, as Megatron-LM's
TPxDP all-reduce; in the pseudo phase also every pipeline stage that calls the shared slot) in one
all-reduce of a [MoE modules, E] table over all ranks, so every replica of a bias takes the same
step. Tensor-parallel ranks route the same tokens: they multiply every count of a router by TP,
which changes no sign.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe.router import Router

BUFFER = "mlp.router.expert_bias"


def bias_name(module_key: int) -> str:
    """The bias of the decoder's MoE module ``module_key`` (its buffer's name in the model)."""
    return f"layers.{module_key}.{BUFFER}"


def mtp_bias_name(depth: int) -> str:
    """The bias of multi-token prediction depth ``depth`` (0-based, as the model's ``mtp.layers``):
    its buffer's name, under ``mtp.``, so it never collides with a layer's."""
    return f"mtp.layers.{depth}.layer.{BUFFER}"


def expert_bias_names(m: ModelConfig, module_keys: Sequence[int]) -> List[str]:
    """Every bias of the whole model, in the same order on every rank: the MoE modules among
    ``module_keys`` (the model's), then the MTP depths when they are MoE (the last layer's kind)."""
    names = [bias_name(k) for k in sorted({k for k in module_keys if m.is_moe_layer(k)})]
    if m.mtp_num_layers and m.is_moe_layer(m.num_layers - 1):
        names += [mtp_bias_name(d) for d in range(m.mtp_num_layers)]
    return names if m.expert_bias else []


def updated_expert_bias(tokens_per_expert: torch.Tensor, bias: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean load - load)`` per expert (last dim), the mean over the experts."""
    mean = tokens_per_expert.sum(-1, keepdim=True) / tokens_per_expert.shape[-1]
    return bias + torch.sign(mean - tokens_per_expert) * rate


class _CountOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, counts, into):
        ctx.counts, ctx.into = counts, into
        return rows

    @staticmethod
    def backward(ctx, grad):
        ctx.into.add_(ctx.counts)
        return grad, None, None


def count_on_backward(rows: torch.Tensor, counts: Sequence[int], router: Router) -> torch.Tensor:
    """``rows`` unchanged; their backward adds ``counts`` (assignments per global expert) to the
    router's ``tokens_per_expert``."""
    if router.tokens_per_expert is None or not rows.requires_grad:
        return rows
    counts_t = torch.tensor(counts, dtype=torch.float32, device=router.tokens_per_expert.device)
    return _CountOnBackward.apply(rows, counts_t, router.tokens_per_expert)


def biased_routers(model: torch.nn.Module) -> Dict[str, Router]:
    """Bias name (``bias_name``, ``mtp_bias_name``) -> its router, for this stage's routers with
    an expert bias."""
    return {
        f"{name}.expert_bias": module
        for name, module in model.named_modules()
        if isinstance(module, Router) and module.expert_bias is not None
    }


def update_expert_biases(
    model: torch.nn.Module, names: Sequence[str], num_experts: int, rate: float, device: torch.device
) -> None:
    """After a step's backward (collective over all ranks when there are several, also those
    whose stage has no MoE router): each bias of ``model`` updated from its counts summed over
    every rank, the counts zeroed. ``names``: every bias of the whole model (``expert_bias_names``),
    in the same order on every rank."""
    routers = biased_routers(model)
    row_of = {k: i for i, k in enumerate(names)}
    table = torch.zeros(len(names), num_experts, device=device)
    for key, router in routers.items():
        table[row_of[key]] = router.tokens_per_expert
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    with torch.no_grad():
        for key, router in routers.items():
            router.expert_bias.copy_(updated_expert_bias(table[row_of[key]], router.expert_bias, rate))
            router.tokens_per_expert.zero_()
