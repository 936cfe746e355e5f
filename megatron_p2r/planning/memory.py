"""Bytes a rank holds: parameters, gradients and optimizer state, and what offload moves to host.

As the training code stores them (the ParallelPlan's ``module_state_bytes``, exact): weights in
their dtype (4 B, or 2 B with --bf16/--fp16), fp32 gradient buffers (4 B, bucket padding
included), and the optimizer state of what the rank steps — AdamW moments (8 B; 4–6 B with
16-bit moments under --use-precision-aware-optimizer) plus fp32 mains
of 16-bit weights (4 B); under the distributed optimizer only the rank's shard of each buffer.
With --moe-router-enable-expert-bias also the routers' fp32 buffers (``expert_bias_bytes``),
which stay on the device whatever is offloaded.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from megatron_p2r.config import Config, build_step_plan, parse_offload_what
from megatron_p2r.layout.offload import CATEGORIES, add_bytes, delayed_grads_bytes, memory_plan, nvme_split
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Coords
from megatron_p2r.moe.expert_bias import expert_bias_names, mtp_bias_name

EXPERT_BIAS_BUFFERS = 2  # a router's expert_bias and tokens_per_expert (moe/router.py)


def logical_parameter_count(plan: ParallelPlan) -> int:
    """Parameters of the model, each logical tensor once (stage replicas, TP replicas and
    pseudo-phase slots counted once). Independent of the plan's layout."""
    tp, ep = plan.layout.tp, plan.layout.ep
    seen: Dict[str, int] = {}
    for stage in range(len(plan.stages)):
        for s in plan.tensors(stage):
            seen.setdefault(s.logical, s.global_numel(tp, ep))
    return sum(seen.values())


def _logical_counts(plan: ParallelPlan, keep) -> int:
    """Logical parameters of the tensors ``keep(spec)`` selects, each once."""
    seen: Dict[str, int] = {}
    for stage in range(len(plan.stages)):
        for s in plan.tensors(stage):
            if keep(s):
                seen.setdefault(s.logical, s.global_numel(plan.layout.tp, plan.layout.ep))
    return sum(seen.values())


def expert_parameter_count(plan: ParallelPlan) -> int:
    """Logical parameters of the experts alone (weights and biases of every expert)."""
    return _logical_counts(plan, lambda s: s.expert)


def mtp_parameter_count(plan: ParallelPlan) -> int:
    """Logical parameters of the multi-token prediction depths (model/mtp.py), which share the
    embedding and output layer: DeepSeek-V3 publishes them apart from its 671B."""
    return _logical_counts(plan, lambda s: s.name.startswith("mtp."))


def active_parameter_count(plan: ParallelPlan, with_mtp: bool = False) -> int:
    """Parameters one token's forward meets (DeepSeek-V3's "activated" count): every tensor but
    the routed experts, of which a token meets ``moe_slots`` of ``num_experts`` in each MoE layer
    (embedding and output layer included, as DeepSeek counts them); the MTP depths only with
    ``with_mtp``. In the pseudo phase: of the slots it holds."""
    m = plan.model
    if with_mtp:
        total, experts = logical_parameter_count(plan), expert_parameter_count(plan)
    else:
        total = logical_parameter_count(plan) - mtp_parameter_count(plan)
        experts = _logical_counts(plan, lambda s: s.expert and not s.name.startswith("mtp."))
    if not experts:
        return total
    return total - experts + experts * m.moe_slots // m.num_experts


def stage_expert_biases(plan: ParallelPlan, stage: int) -> List[str]:
    """The expert biases a rank of ``stage`` holds (``expert_bias_names``): one router per MoE
    module the stage calls (a pseudo slot's once, however often the stage calls it), and on the
    last stage the MoE multi-token prediction depths'. Every TP and EP rank of the stage holds
    them all (the router is replicated)."""
    st, m = plan.stage(stage), plan.model
    depths = {mtp_bias_name(d) for d in range(m.mtp_num_layers or 0)}
    return [n for n in expert_bias_names(m, st.layer_keys) if st.last or n not in depths]


def expert_bias_bytes(plan: ParallelPlan, stage: int) -> int:
    """Bytes of the routers' expert-bias buffers on a rank of ``stage``: [E] fp32 each, whatever
    the weights' dtype (``Router._apply`` keeps them fp32)."""
    routers = len(stage_expert_biases(plan, stage))
    return routers * EXPERT_BIAS_BUFFERS * plan.model.num_experts * 4 if routers else 0


def stage_state_bytes(plan: ParallelPlan, stage: int, coords: Optional[Coords] = None) -> Dict[str, int]:
    """Bytes of weights, gradients and optimizer state a rank of ``stage`` holds (``coords``: which
    rank; default the first of each reduction group, which owns the most)."""
    total: Dict[str, int] = {}
    for part in plan.module_state_bytes(stage, coords).values():
        total = add_bytes(total, part)
    return {c: total.get(c, 0) for c in CATEGORIES + ("masters", "stepped")}


def stepped_elements(state: Dict[str, int]) -> int:
    """Elements the optimizer steps (``state``: ``stage_state_bytes`` or a module's part of it)."""
    return state["stepped"]


def offload_plan(cfg: Config, plan: ParallelPlan, stage: int) -> Dict[str, object]:
    """What offload puts on host for a rank of ``stage``: the plan's choice, with the same
    accounting as the runtime (``layout.offload.memory_plan``); ``device`` also has the expert-bias
    buffers (``buffers``) when the model has them.

    ``recomputed``: modules whose weights live on host (run recomputed with fetched copies,
    moving 3 x their weights per micro-batch: fetch forward, fetch backward, gradient back);
    with --cpu-offload-what optimizer only the moments live on host and each step moves the
    mains and gradients to host and the mains back, in their dtypes (``moved_per_step``). With
    --cpu-offload-optimizer-nvme-path the host's optimizer bytes (the mains of 16-bit weights and
    the state) go to the local NVMe instead (``nvme``), and the host keeps the page cache of the
    layer stepping and the one read ahead (``nvme_window``: twice the largest layer's; offload/nvme.py).
    With --cpu-offload-delayed-param-update the host also holds the offloaded layers' second
    gradient buffer (``grads_delayed``, in --main-grads-dtype: optim/delayed_update.py).
    """
    st = plan.stage(stage)
    o = cfg.offload
    what = parse_offload_what(o.cpu_offload_what)
    modules = plan.module_state_bytes(stage)
    per_module = {k: v for k, v in modules.items() if k is not None}
    chosen = list(st.offloaded)
    placed = memory_plan(stage_state_bytes(plan, stage), per_module, chosen, o.offload_prefetch, what)
    layers = [i for i, k in zip(st.layers, st.layer_keys, strict=True) if k in chosen]
    weights = sum(per_module[k]["params"] for k in chosen)
    stepped = sum(stepped_elements(per_module[k]) for k in chosen)
    on_host = "params" in what
    host, nvme = placed["host"], 0
    steps = build_step_plan(cfg)
    if steps.nvme_path is not None:
        host, nvme = nvme_split(host, per_module, chosen)
    if steps.delayed and chosen:
        host = {**host, "grads_delayed": delayed_grads_bytes(per_module, chosen)}
    device = placed["device"]
    if plan.model.expert_bias:  # on the device whatever is offloaded (offload/__init__.py)
        device = {**device, "buffers": expert_bias_bytes(plan, stage)}
    return {
        "modules": chosen,
        "layers": layers,
        "device": device,
        "host": host,
        "nvme": nvme,
        "what": ",".join(sorted(what)),
        "recomputed": chosen if on_host else [],
        "host_optimizer_params": stepped,
        "moved_per_microbatch": 3 * weights if on_host else 0,
        "moved_per_step": 0 if on_host else (2 * plan.buffers.main_bytes + plan.buffers.grad_bytes) * stepped,
    }
