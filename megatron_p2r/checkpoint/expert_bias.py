"""The MoE routers' expert biases in a checkpoint (``--moe-router-enable-expert-bias``).

A bias is model state but not a parameter: no gradient, no optimizer state, fp32, one [E] vector
per MoE module, identical on every rank that holds its router (``moe/expert_bias.py``). So it
lives in metadata.json, field ``expert_bias`` — {``layers.K.mlp.router.expert_bias``: E numbers,
and for MoE multi-token prediction depths ``mtp.layers.D.layer.mlp.router.expert_bias``: the
buffers' names in the model, so a depth's never collides with a layer's}, exact (an fp32 value written as JSON's double round-trips), covered by the file's own checksum —
instead of the shard files, whose entries follow the parameters and their optimizer state. Being
layout-free, it reshards for nothing; delinking and growth copy module K's bias to every module
that copies K's weights, and the MTP depths' biases as they are (``convert/reshard.py``). A
checkpoint written before the depths' biases were kept has none: they start at 0.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.moe.expert_bias import bias_name, biased_routers, mtp_bias_name

__all__ = ["FIELD", "bias_name", "mtp_bias_name", "collect_expert_biases", "restore_expert_biases", "valid_field"]

FIELD = "expert_bias"


def collect_expert_biases(model: torch.nn.Module, ps) -> Optional[Dict[str, List[float]]]:
    """Every router's bias of the whole model, on rank 0 (None elsewhere, and on rank 0 when the
    model has none). Collective when there are several ranks: each stage holds its own layers'."""
    if not model.cfg.model.moe_router_enable_expert_bias:  # the same on every rank: no collective
        return None
    mine = {name: r.expert_bias.detach().cpu().tolist() for name, r in biased_routers(model).items()}
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
    zero, and one written before the MTP depths' biases were kept starts those at zero (said once,
    on rank 0 of the caller)."""
    routers = biased_routers(model)
    if not routers:
        return
    saved = meta.get(FIELD)
    if saved is None:
        _say(f"{where}: no expert biases saved (a run without --moe-router-enable-expert-bias); they start at 0")
        return
    unsaved_mtp = sorted(n for n in routers if n.startswith("mtp.") and n not in saved)
    if unsaved_mtp:
        _say(f"{where}: no expert bias saved for the MTP depths' routers (an older checkpoint); they start at 0")
    for name, router in routers.items():
        if name in unsaved_mtp:
            continue
        values = saved.get(name)
        if values is None or len(values) != router.expert_bias.numel():
            raise CheckpointError(f"{where}: field {FIELD!r} has no {router.expert_bias.numel()} values for {name!r}")
        with torch.no_grad():
            router.expert_bias.copy_(torch.tensor(values, dtype=torch.float32))


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line)


def valid_field(value) -> bool:
    """metadata.json's ``expert_bias``: names to lists of numbers."""
    return isinstance(value, dict) and all(
        isinstance(k, str)
        and isinstance(v, list)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        for k, v in value.items()
    )
