"""Bytes a rank holds: parameters, gradients and optimizer state, and what offload moves to host.

As this project stores them: fp32 parameters that are the master weights (4 B), fp32
gradients (4 B), AdamW moments (8 B); the tensors come from the ParallelPlan's tensor table.
"""
from __future__ import annotations

from typing import Dict

from megatron_p2r.config import Config, parse_offload_what
from megatron_p2r.layout.offload import PARAM_BYTES, memory_plan, state_bytes
from megatron_p2r.layout.plan import ParallelPlan


def logical_parameter_count(plan: ParallelPlan) -> int:
    """Parameters of the model, each logical tensor once (stage replicas, TP replicas and
    pseudo-phase slots counted once). Independent of the plan's layout."""
    tp, ep = plan.layout.tp, plan.layout.ep
    seen: Dict[str, int] = {}
    for stage in range(len(plan.stages)):
        for s in plan.tensors(stage):
            seen.setdefault(s.logical, s.global_numel(tp, ep))
    return sum(seen.values())


def expert_parameter_count(plan: ParallelPlan) -> int:
    """Logical parameters of the experts alone (weights and biases of every expert)."""
    seen: Dict[str, int] = {}
    for stage in range(len(plan.stages)):
        for s in plan.tensors(stage):
            if s.expert:
                seen.setdefault(s.logical, s.global_numel(plan.layout.tp, plan.layout.ep))
    return sum(seen.values())


def stage_state_bytes(plan: ParallelPlan, stage: int) -> Dict[str, int]:
    """Bytes of parameters, gradients and AdamW moments a rank of ``stage`` holds."""
    return state_bytes(sum(s.numel for s in plan.tensors(stage)))


def offload_plan(cfg: Config, plan: ParallelPlan, stage: int) -> Dict[str, object]:
    """What offload puts on host for a rank of ``stage``: the plan's choice, with the same
    accounting as the runtime (``layout.offload.memory_plan``).

    ``recomputed``: modules whose weights live on host (run recomputed with fetched copies,
    moving 3 x their fp32 weights per micro-batch: fetch forward, fetch backward, gradient
    back); with --cpu-offload-what optimizer only the moments live on host and each step moves
    the weights and gradients to host and the weights back (``moved_per_step``).
    """
    st = plan.stage(stage)
    o = cfg.offload
    what = parse_offload_what(o.cpu_offload_what)
    per_module = {k: state_bytes(n) for k, n in plan.module_numel(stage).items()}
    chosen = list(st.offloaded)
    placed = memory_plan(stage_state_bytes(plan, stage), per_module, chosen, o.offload_prefetch, what)
    layers = [i for i, k in zip(st.layers, st.layer_keys) if k in chosen]
    weights = sum(per_module[k]["params"] for k in chosen)
    on_host = "params" in what
    return {"modules": chosen, "layers": layers, "device": placed["device"], "host": placed["host"],
            "what": ",".join(sorted(what)), "recomputed": chosen if on_host else [],
            "host_optimizer_params": weights // PARAM_BYTES,
            "moved_per_microbatch": 3 * weights if on_host else 0, "moved_per_step": 0 if on_host else 3 * weights}
