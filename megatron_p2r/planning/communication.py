"""Communication volume per step of each group a rank is in (tp, ep, pp, dp, expert_dp,
embedding, sharing), following the collectives the code issues (see docs/scale.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.layout.offload import GRAD_BYTES
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import stage_set_groups
from megatron_p2r.planning.activations import moe_rows


def _ring(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


@dataclass
class GroupTraffic:
    """Bytes one rank sends per step over one kind of group, and the group's size/links."""

    bytes: float = 0.0
    size: int = 1
    nodes: int = 1          # nodes the group spans (1: NVLink only)
    offnode_fraction: float = 0.0   # of the bytes, the part that leaves the node (all-to-all)


def _nodes(ranks: Sequence[int], per_node: int) -> int:
    return len({r // per_node for r in ranks})


def communication(cfg: Config, plan: ParallelPlan, stage: int, gpus_per_node: int = 8,
                  offloaded: Sequence[int] = ()) -> Dict[str, GroupTraffic]:
    """Per-step bytes a rank of ``stage`` sends over each group (tp, ep, pp, dp, expert_dp,
    embedding, sharing), following the collectives the code issues (see docs/scale.md)."""
    m, t, layout = cfg.model, cfg.train, plan.layout
    a = 2 if (t.bf16 or t.fp16) else 4
    n, h = t.micro_batch_size * m.seq_length, m.hidden_size
    mbs = num_microbatches(cfg, layout.world_size)
    st = plan.stage(stage)
    first, last = st.first, st.last
    stage_keys = st.layer_keys
    rank = layout.rank(0, 0, stage)
    T, E = layout.tp, layout.ep
    out: Dict[str, GroupTraffic] = {}

    tp_bytes = ep_bytes = 0.0
    for key in stage_keys:
        forwards = 2 if (t.recompute_activations or key in offloaded) else 1
        moe = m.is_moe_layer(key)
        tp_bytes += forwards * 2 * _ring(n * h * a, T)                 # attention proj + MLP reduce
        tp_bytes += _ring(n * h * 4, T) + _ring(n * h * (a if moe else 4), T)   # backward of the copies
        if moe:
            _, rows = moe_rows(cfg, n)
            tp_bytes += _ring(rows * 4, T)                               # combine weights' copy
            if m.add_bias:
                tp_bytes += _ring(m.num_experts // E * h * 4, T)          # bias2's copy
            ep_bytes += (forwards + 1) * 2 * rows * h * a * (E - 1) / E   # dispatch + combine
    if first:
        tp_bytes += _ring(n * h * 4, T)                                  # vocab-parallel embedding
    if last:
        tp_bytes += _ring(n * h * 4, T) + 3 * _ring(n * 4, T)            # output copy, cross entropy
    tp_ranks = layout.group_of("tp", rank)
    out["tp"] = GroupTraffic(mbs * tp_bytes, T, _nodes(tp_ranks, gpus_per_node))
    ep_ranks = layout.group_of("ep", rank)
    same_node = sum(1 for r in ep_ranks if r // gpus_per_node == rank // gpus_per_node) - 1
    out["ep"] = GroupTraffic(mbs * ep_bytes, E, _nodes(ep_ranks, gpus_per_node),
                             1.0 - same_node / (E - 1) if E > 1 else 0.0)
    chunks = plan.num_model_chunks   # every chunk boundary is a transfer each way
    sends = (chunks - (1 if last else 0)) + (chunks - (1 if first else 0))
    pp_nodes = 1
    if layout.pp > 1:
        neighbours = [layout.rank(0, 0, s_) for s_ in (stage - 1, stage + 1) if 0 <= s_ < layout.pp]
        pp_nodes = max(_nodes([rank, r], gpus_per_node) for r in neighbours)
    out["pp"] = GroupTraffic(mbs * sends * n * h * 4, layout.pp, pp_nodes)

    out.update(gradient_traffic(plan, stage, gpus_per_node))
    return out


def gradient_traffic(plan: ParallelPlan, stage: int, gpus_per_node: int = 8) -> Dict[str, GroupTraffic]:
    """Per-step bytes a rank of ``stage`` sends reducing gradients, per kind of reduction
    (dp, expert_dp, embedding, sharing: the plan's ``Reduction`` of each parameter)."""
    layout = plan.layout
    rank = layout.rank(0, 0, stage)
    grads: Dict[str, List[float]] = {"dp": [0, layout.dp, 0], "expert_dp": [0, layout.expert_dp, 0],
                                      "embedding": [0, 1, 1], "sharing": [0, 1, 1]}
    grads["dp"][2] = _nodes(layout.group_of("dp", rank), gpus_per_node)
    grads["expert_dp"][2] = _nodes(layout.group_of("expert_dp", rank), gpus_per_node)
    for s_ in plan.tensors(stage):
        red = plan.reduction(s_.logical, s_.expert)
        if red.stages:
            size = len(red.stages) * (layout.expert_dp if s_.expert else layout.dp)
            group = next(g for g in stage_set_groups(layout, red.stages, red.over) if rank in g)
            entry = grads[red.kind]
            entry[0] += _ring(s_.numel * GRAD_BYTES, size)
            entry[1] = max(entry[1], size)
            entry[2] = max(entry[2], _nodes(group, gpus_per_node))
        else:
            grads[red.over][0] += _ring(s_.numel * GRAD_BYTES, grads[red.over][1])
    return {kind: GroupTraffic(nbytes, int(size), int(nodes)) for kind, (nbytes, size, nodes) in grads.items()}
