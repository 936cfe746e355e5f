"""The MoE routers' expert biases in a checkpoint (``--moe-router-enable-expert-bias``).

A bias is model state but not a parameter: no gradient, no optimizer state, fp32, one [E] vector
per MoE module, identical on every rank that holds its router (``moe/expert_bias.py``). So it
lives in metadata.json, field ``expert_bias`` — {``layers.K.mlp.router.expert_bias``: E numbers},
exact (an fp32 value written as JSON's double round-trips), covered by the file's own checksum —
instead of the shard files, whose entries follow the parameters and their optimizer state. Being
layout-free, it reshards for nothing; delinking and growth copy module K's bias to every module
that copies K's weights (``convert/reshard.py``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.moe.expert_bias import biased_routers

FIELD = "expert_bias"


def bias_name(module_key: int) -> str:
    return f"layers.{module_key}.mlp.router.expert_bias"


def collect_expert_biases(model: torch.nn.Module, ps) -> Optional[Dict[str, List[float]]]:
    """Every router's bias of the whole model, on rank 0 (None elsewhere, and on rank 0 when the
    model has none). Collective when there are several ranks: each stage holds its own layers'."""
    if not model.cfg.model.moe_router_enable_expert_bias:  # the same on every rank: no collective
        return None
    mine = {bias_name(k): r.expert_bias.detach().cpu().tolist() for k, r in biased_routers(model).items()}
    if ps.layout.world_size == 1:
        return mine or None
    gathered = [None] * ps.layout.world_size if ps.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ps.rank != 0:
        return None
    merged: Dict[str, List[float]] = {}
    for part in gathered:
        merged.update(part)  # replicas (TP, DP, stages sharing a slot) hold equal values
    return dict(sorted(merged.items())) or None


def restore_expert_biases(model: torch.nn.Module, meta: dict, where: str) -> None:
    """Each router's bias from ``meta``; a checkpoint written without expert biases starts them at
    zero (said once, on rank 0 of the caller)."""
    routers = biased_routers(model)
    if not routers:
        return
    saved = meta.get(FIELD)
    if saved is None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{where}: no expert biases saved (a run without --moe-router-enable-expert-bias); they start at 0")
        return
    for key, router in routers.items():
        values = saved.get(bias_name(key))
        if values is None or len(values) != router.expert_bias.numel():
            raise CheckpointError(
                f"{where}: field {FIELD!r} has no {router.expert_bias.numel()} values for {bias_name(key)!r}"
            )
        with torch.no_grad():
            router.expert_bias.copy_(torch.tensor(values, dtype=torch.float32))


def valid_field(value) -> bool:
    """metadata.json's ``expert_bias``: names to lists of numbers."""
    return isinstance(value, dict) and all(
        isinstance(k, str)
        and isinstance(v, list)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        for k, v in value.items()
    )
