"""Communication volume per step of each group a rank is in (tp, cp, ep, pp, dp, expert_dp,
embedding, sharing, tp_partial), following the collectives the code issues (see docs/scale.md):
with sequence parallelism, all-gathers and reduce-scatters along the sequence instead of TP
all-reduces, 1/TP of the activation between stages.

Activations travel in the weights' dtype (fp32, or 16-bit with --bf16/--fp16: the model computes
in its weights' dtype); gradients are reduced in fp32 — one all-reduce, or under the distributed
optimizer a reduce-scatter of the fp32 gradients plus an all-gather of the updated weights.
Partial gradients over TP (sequence parallelism's norms and biases, replicated key/value heads)
are reduced with their data-parallel copies (``tp_partial``: TP block x DP). With
--moe-router-enable-expert-bias every rank all-reduces the routers' counts after each step
(``expert_bias``: one fp32 [biases, E] table over all ranks, moe/expert_bias.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import stage_set_groups
from megatron_p2r.context.traffic import sent_bytes
from megatron_p2r.moe.expert_bias import expert_bias_names
from megatron_p2r.planning.activations import (
    compute_bytes,
    cut_positions,
    expert_rows,
    local_sequence,
    moe_rows,
    recomputed_positions,
)


def _ring(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


@dataclass
class GroupTraffic:
    """Bytes one rank sends per step over one kind of group, and the group's size/links."""

    bytes: float = 0.0
    size: int = 1
    nodes: int = 1  # nodes the group spans (1: NVLink only)
    offnode_fraction: float = 0.0  # of the bytes, the part that leaves the node (all-to-all)
    per_node: int = 1  # members of the group on one node (ring collectives share the node's network)


def _nodes(ranks: Sequence[int], per_node: int) -> int:
    return len({r // per_node for r in ranks})


def _per_node(ranks: Sequence[int], per_node: int) -> int:
    """The fewest members of the group any of its nodes holds."""
    counts: Dict[int, int] = {}
    for r in ranks:
        counts[r // per_node] = counts.get(r // per_node, 0) + 1
    return min(counts.values())


def _gather(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of a ``nbytes`` tensor."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def _tp_layer_bytes(cfg: Config, moe: bool, forwards: int, n: int, T: int, sp: bool) -> float:
    """TP bytes one layer sends per micro-batch: ``forwards`` forward passes and one backward.
    Each column-parallel input (the attention's: one, or query and key/value under
    --group-query-attention; fc1 or the experts') enters the TP region by its own copy (or
    all-gather under SP)."""
    m, a, h = cfg.model, compute_bytes(cfg), cfg.model.hidden_size
    columns = (2 if m.group_query_attention else 1) + 1
    # --qk-layernorm-over-heads: the q and k norms all-reduce a fp32 sum of squares per token, and its gradient
    stats = (forwards + 1) * 2 * _ring(n * 4, T) if m.qk_layernorm_over_heads else 0.0
    if not sp:
        out = stats + forwards * 2 * _ring(n * h * a, T)  # attention proj + MLP reduce
        out += columns * _ring(n * h * a, T)  # backward of the copies
        if moe:
            out += _ring(moe_rows(cfg, n)[1] * 4, T)  # combine weights' copy (fp32)
        return out
    # all-gather before each column-parallel projection (again in backward for the weight
    # gradients), reduce-scatter after proj and fc2; backward: reduce-scatter of the input
    # gradients, all-gather of the output's
    out = stats + forwards * (columns + 2) * _gather(n * h * a, T) + (2 * columns + 2) * _gather(n * h * a, T)
    if moe:  # routing ids and combine weights gathered too, their gradient reduce-scattered; the
        # tokens are not gathered again in backward (the experts keep their rows)
        slots = moe_rows(cfg, n)[0]
        out += forwards * _gather(n * slots * 12, T) + _gather(n * slots * 4, T) - _gather(n * h * a, T)
    return out


def context_layer_bytes(cfg: Config, T: int, forwards: int) -> float:
    """Bytes a CP rank sends for one layer and micro-batch (``cfg`` at its local length):
    ``context.traffic.sent_bytes`` (what the collectives are handed) for this TP rank's heads and
    key/value heads, ``forwards`` times the forward's (recomputation repeats it) and one backward."""
    m, p = cfg.model, cfg.parallel
    if p.context_parallel_size == 1:
        return 0.0
    fwd, bwd = sent_bytes(
        p.cp_comm_type,
        p.context_parallel_size,
        cfg.train.micro_batch_size,
        m.num_attention_heads // T,
        max(m.query_groups // T, 1),
        m.seq_length,
        m.head_dim,
        compute_bytes(cfg),
    )
    return forwards * fwd + bwd


def communication(
    cfg: Config, plan: ParallelPlan, stage: int, gpus_per_node: int = 8, offloaded: Sequence[int] = ()
) -> Dict[str, GroupTraffic]:
    """Per-step bytes a rank of ``stage`` sends over each group (tp, cp, ep, pp, dp, expert_dp,
    embedding, sharing, tp_partial; expert_bias with the expert bias), following the collectives
    the code issues (see docs/scale.md)."""
    cfg = local_sequence(cfg)  # a CP rank's tokens: every module but attention's core runs on them
    m, t, layout = cfg.model, cfg.train, plan.layout
    a = compute_bytes(cfg)
    n, h = t.micro_batch_size * m.seq_length, m.hidden_size
    mbs = num_microbatches(cfg, layout.world_size)
    st = plan.stage(stage)
    first, last = st.first, st.last
    rank = layout.rank(0, 0, stage)
    T, E, sp = layout.tp, layout.ep, plan.sequence_parallel
    out: Dict[str, GroupTraffic] = {}

    twice = recomputed_positions(cfg, st, offloaded)
    cut = cut_positions(cfg, st, offloaded)  # recomputed without their all-to-alls
    tp_bytes = ep_bytes = cp_bytes = 0.0
    for position, key in enumerate(st.layer_keys):
        forwards = 2 if position in twice else 1
        cp_bytes += context_layer_bytes(cfg, T, forwards + (1 if t.recompute == "selective" else 0))
        moe = m.is_moe_layer(key)
        tp_bytes += _tp_layer_bytes(cfg, moe, forwards, n, T, sp)
        if moe:
            rows = expert_rows(cfg, n)
            if m.add_bias:
                tp_bytes += _ring(m.num_experts // E * h * a, T)  # bias2's copy
            ep_bytes += (
                ((1 if position in cut else forwards) + 1) * 2 * rows * h * a * (E - 1) / E
            )  # dispatch + combine
    if last and m.mtp_num_layers and m.is_moe_layer(m.num_layers - 1):
        # each MTP depth's MoE layer (model/mtp.py: the last layer's kind), never recomputed: its
        # dispatch and combine once forward, once backward. Its TP collectives are not counted yet.
        ep_bytes += m.mtp_num_layers * 2 * 2 * expert_rows(cfg, n) * h * a * (E - 1) / E
    if first:  # vocab-parallel embedding: all-reduce, or reduce-scatter (and all-gather back)
        tp_bytes += 2 * _gather(n * h * a, T) if sp else _ring(n * h * a, T)
    if last:  # the output layer's input (gathered twice and its gradient reduce-scattered under SP, or
        # the copy's all-reduce), and the cross entropy's all-gather of two fp32 numbers per token
        tp_bytes += (3 * _gather(n * h * a, T) if sp else _ring(n * h * a, T)) + _gather(T * n * 8, T)
    out["cp"] = GroupTraffic(mbs * cp_bytes, layout.cp, _nodes(layout.group_of("cp", rank), gpus_per_node))
    tp_ranks = layout.group_of("tp", rank)
    out["tp"] = GroupTraffic(mbs * tp_bytes, T, _nodes(tp_ranks, gpus_per_node))
    ep_ranks = layout.group_of("ep", rank)
    same_node = sum(1 for r in ep_ranks if r // gpus_per_node == rank // gpus_per_node) - 1
    out["ep"] = GroupTraffic(
        mbs * ep_bytes, E, _nodes(ep_ranks, gpus_per_node), 1.0 - same_node / (E - 1) if E > 1 else 0.0
    )
    chunks = plan.num_model_chunks  # every chunk boundary is a transfer each way
    sends = (chunks - (1 if last else 0)) + (chunks - (1 if first else 0))
    pp_nodes = 1
    if layout.pp > 1:
        neighbours = [layout.rank(0, 0, s_) for s_ in (stage - 1, stage + 1) if 0 <= s_ < layout.pp]
        pp_nodes = max(_nodes([rank, r], gpus_per_node) for r in neighbours)
    out["pp"] = GroupTraffic(mbs * sends * n // (T if sp else 1) * h * a, layout.pp, pp_nodes)

    out.update(gradient_traffic(plan, stage, gpus_per_node))
    if m.expert_bias:
        out["expert_bias"] = expert_bias_traffic(plan, gpus_per_node)
    return out


def expert_bias_table_bytes(plan: ParallelPlan) -> int:
    """Bytes of the table ``update_expert_biases`` all-reduces each step: fp32 [every bias of the
    whole model, E], the same on every rank (also those whose stage has no router)."""
    return len(expert_bias_names(plan.model, plan.layer_keys)) * plan.model.num_experts * 4


def expert_bias_traffic(plan: ParallelPlan, gpus_per_node: int = 8) -> GroupTraffic:
    """Per-step bytes a rank sends in the expert-bias counts' all-reduce over all ranks (a ring)."""
    ranks = range(plan.layout.world_size)
    size = len(ranks)
    return GroupTraffic(
        _ring(expert_bias_table_bytes(plan), size),
        size,
        _nodes(ranks, gpus_per_node),
        per_node=_per_node(ranks, gpus_per_node),
    )


def gradient_traffic(plan: ParallelPlan, stage: int, gpus_per_node: int = 8) -> Dict[str, GroupTraffic]:
    """Per-step bytes a rank of ``stage`` sends reducing gradients, per kind of reduction (dp,
    expert_dp, embedding, sharing, tp_partial: the plan's ``Reduction`` of each parameter): a
    ring all-reduce of the fp32 gradients, or under the distributed optimizer a reduce-scatter of
    them and an all-gather of the weights (each (n-1)/n of the data)."""
    layout = plan.layout
    rank = layout.rank(0, 0, stage)
    out = {kind: GroupTraffic() for kind in ("dp", "expert_dp", "embedding", "sharing", "tp_partial")}
    groups: Dict[Tuple[Tuple[int, ...], str, int], List[int]] = {}  # a stage's tensors share a few groups
    for s_ in plan.tensors(stage):
        red = plan.reduction(s_.logical, s_.expert)
        size = plan.group_members(red.over, red.stages, red.tp_block)
        if size == 1:
            continue
        key = (red.stages or (stage,), red.over, red.tp_block)
        if key not in groups:
            groups[key] = next(g for g in stage_set_groups(layout, *key) if rank in g)
        group = groups[key]
        if plan.buffers.distributed:
            sent = (size - 1) / size * s_.numel * (plan.buffers.grad_bytes + plan.buffers.param_bytes)
        else:
            sent = _ring(s_.numel * plan.buffers.grad_bytes, size)
        t = out[red.kind]
        t.bytes += sent
        t.size = max(t.size, size)
        t.nodes = max(t.nodes, _nodes(group, gpus_per_node))
        t.per_node = max(t.per_node, _per_node(group, gpus_per_node))
    return out
