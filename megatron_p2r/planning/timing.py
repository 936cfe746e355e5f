"""Time on paper: FLOPs per micro-batch of a stage and the time a link takes for a volume."""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.activations import expert_rows, recomputed_positions
from megatron_p2r.planning.communication import GroupTraffic
from megatron_p2r.planning.hardware import GPUSpec


def stage_flops_per_microbatch(cfg: Config, plan: ParallelPlan, stage: int, offloaded: Sequence[int] = ()) -> float:
    """Training FLOPs one rank of ``stage`` computes per micro-batch: 3x the forward matmuls
    (one more forward for layers recomputed in full, one more attention core under selective
    recomputation), the same convention as ``metrics.model_flops_per_token``; the loss
    recomputes its logits in backward (``parallel/cross_entropy.py``): 4x the output layer.
    Key/value heads replicated over TP (TP > query groups) are computed on every replica. Experts
    multiply the rows of balanced routing (``expert_rows``: exact with --moe-grouped-gemm,
    dropless; the padded experts multiply padding rows too when routing is imbalanced). A CP
    rank runs every matmul on its s/CP tokens and 1/CP of the attention core: the load-balanced
    chunks give every rank the same causal work (``context.chunks``). The last stage's MTP
    depths: a layer of the last layer's kind, the 2h -> h projection and the output layer each."""
    m, t = cfg.model, cfg.train
    n, h, T = t.micro_batch_size * m.seq_length // plan.layout.cp, m.hidden_size, plan.layout.tp
    st = plan.stage(stage)
    twice = recomputed_positions(cfg, st, offloaded)
    _, core = _attention_flops(cfg, n, T, plan.sequence_parallel)
    total = 0.0
    for position, key in enumerate(st.layer_keys):
        fwd = _layer_forward_flops(cfg, plan, key, n)
        total += fwd * (4 if position in twice else 3) + (core if t.recompute == "selective" else 0)
    if st.last:
        depths = m.mtp_num_layers or 0  # multi-token prediction (model/mtp.py): never recomputed
        total += 4 * 2 * n * m.padded_vocab_size * h / T * (1 + depths)
        total += depths * 3 * (_layer_forward_flops(cfg, plan, m.num_layers - 1, n) + 2 * n * 2 * h * h / T)
    return total


def _attention_flops(cfg: Config, n: int, T: int, sequence_parallel: bool) -> tuple:
    """(projections, core) forward FLOPs of one attention layer on a rank of ``n`` tokens."""
    m = cfg.model
    if m.multi_latent_attention:
        return _latent_attention_flops(cfg, n, T, sequence_parallel)
    heads = m.num_attention_heads * m.head_dim / T  # query (and output) rows on a rank
    kv = 2 * m.query_groups * m.head_dim / min(T, m.query_groups)  # key/value rows on a rank
    return 2 * n * m.hidden_size * (2 * heads + kv), 4 * n * m.seq_length * heads


def _layer_forward_flops(cfg: Config, plan: ParallelPlan, key: int, n: int) -> float:
    """Forward FLOPs of layer ``key`` on a rank of ``n`` tokens: attention, then its MLP or experts."""
    m, h, T = cfg.model, cfg.model.hidden_size, plan.layout.tp
    glu = 2 if m.gated_linear_unit else 1
    projections, core = _attention_flops(cfg, n, T, plan.sequence_parallel)
    fwd = projections + core
    if m.is_moe_layer(key):
        rows = expert_rows(cfg, n)
        gates = m.num_experts + (1 if m.moe_shared_expert_gate and m.shared_expert_ffn_size else 0)
        router = 2 * n * gates * h / (T if plan.sequence_parallel else 1)  # and the shared experts' gate
        shared = 2 * n * (glu + 1) * m.shared_expert_ffn_size * h / T  # every token, TP-split as the MLP
        return fwd + router + shared + 2 * rows * (glu + 1) * m.expert_ffn_size * h / T
    return fwd + 2 * n * (glu + 1) * m.ffn_size * h / T


def _latent_attention_flops(cfg: Config, n: int, T: int, sequence_parallel: bool) -> tuple:
    """(projections, core) forward FLOPs of one multi-latent attention layer on a rank: the
    replicated down-projections on every token of the rank (1/TP of them under sequence
    parallelism), the up- and output projections over its heads; scores over the query/key head
    dimension, values over the value head dimension."""
    m = cfg.model
    h, heads = m.hidden_size, m.num_attention_heads / T
    down_tokens = n / T if sequence_parallel else n
    down = m.kv_lora_rank + m.qk_pos_emb_head_dim
    if m.q_lora_rank is None:
        query = n * h * heads * m.q_head_dim
    else:
        down += m.q_lora_rank
        query = n * m.q_lora_rank * heads * m.q_head_dim
    up = query + n * m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim) + n * heads * m.v_head_dim * h
    core = 2 * n * m.seq_length * heads * (m.q_head_dim + m.v_head_dim)
    return 2 * (down_tokens * h * down + up), core


def attention_core_flops(cfg: Config, plan: ParallelPlan) -> float:
    """Forward FLOPs of one layer's attention core on a rank (QK^T and PV over the whole
    sequence for its s/CP queries and heads/TP heads, the same convention as the model FLOPs)."""
    m = cfg.model
    n = cfg.train.micro_batch_size * m.seq_length // plan.layout.cp
    return 4 * n * m.seq_length * m.num_attention_heads * m.head_dim / plan.layout.tp


def exposed_context(cfg: Config, plan: ParallelPlan, cp_time: float, core_time: float) -> float:
    """Seconds of the CP attention's communication (``cp_time`` per micro-batch) not hidden: p2p
    sends each of the N-1 hops (forward and backward) while the blocks of a step compute, so it
    hides behind (N-1)/N of the core's time (``core_time``, forward and backward); allgather and
    a2a wait for their collective before computing: all of it is exposed."""
    cp = plan.layout.cp
    if cp == 1 or cfg.parallel.cp_comm_type != "p2p":
        return cp_time
    return max(0.0, cp_time - core_time * (cp - 1) / cp)


def microbatch_link_times(
    cfg: Config, plan: ParallelPlan, stage: int, comm: Dict[str, GroupTraffic], gpu: GPUSpec, flops_per_s: float
) -> Tuple[float, float, float, Dict[str, float]]:
    """Seconds per micro-batch of the tp (with the CP attention's exposed part: it waits on the
    critical path like a TP collective), ep and pp traffic, and {cp_per_microbatch,
    cp_exposed_per_microbatch}: p2p hides behind the core of every layer of ``stage``, forward
    and backward (3x the forward)."""
    mbs = num_microbatches(cfg, plan.layout.world_size)
    tp, ep, pp, cp = (link_time(comm[k], gpu) / mbs for k in ("tp", "ep", "pp", "cp"))
    core = 3 * len(plan.stage(stage).layer_keys) * attention_core_flops(cfg, plan) / flops_per_s
    exposed = exposed_context(cfg, plan, cp, core)
    return tp + exposed, ep, pp, {"cp_per_microbatch": cp, "cp_exposed_per_microbatch": exposed}


def link_time(traffic: GroupTraffic, gpu: GPUSpec) -> float:
    """Seconds to send ``traffic``: an all-to-all's off-node part over the rank's share of the
    network; a ring collective over G members per node across nodes crosses each node's network
    once per channel — the node sends what one member sends, over the network of all G members
    (the other groups on the node use the rest) — and NVLink carries every member's bytes."""
    if traffic.bytes == 0:
        return 0.0
    if traffic.offnode_fraction:
        return traffic.bytes * (
            traffic.offnode_fraction / gpu.inter_node_bw + (1 - traffic.offnode_fraction) / gpu.intra_node_bw
        )
    if traffic.nodes == 1:
        return traffic.bytes / gpu.intra_node_bw
    return traffic.bytes / min(gpu.intra_node_bw, traffic.per_node * gpu.inter_node_bw)
