"""Time on paper: FLOPs per micro-batch of a stage and the time a link takes for a volume."""

from __future__ import annotations

from typing import Sequence

from megatron_p2r.config import Config
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
    dropless; the padded experts multiply padding rows too when routing is imbalanced)."""
    m, t = cfg.model, cfg.train
    n, h, T = t.micro_batch_size * m.seq_length, m.hidden_size, plan.layout.tp
    st = plan.stage(stage)
    glu = 2 if m.gated_linear_unit else 1
    if m.multi_latent_attention:
        projections, core = _latent_attention_flops(cfg, n, T, plan.sequence_parallel)
    else:
        heads = m.num_attention_heads * m.head_dim / T  # query (and output) rows on a rank
        kv = 2 * m.query_groups * m.head_dim / min(T, m.query_groups)  # key/value rows on a rank
        projections, core = 2 * n * h * (2 * heads + kv), 4 * n * m.seq_length * heads
    twice = recomputed_positions(cfg, st, offloaded)
    total = 0.0
    for position, key in enumerate(st.layer_keys):
        fwd = projections + core
        if m.is_moe_layer(key):
            rows = expert_rows(cfg, n)
            router = 2 * n * m.num_experts * h / (T if plan.sequence_parallel else 1)
            fwd += router + 2 * rows * (glu + 1) * m.expert_ffn_size * h / T
        else:
            fwd += 2 * n * (glu + 1) * m.ffn_size * h / T
        total += fwd * (4 if position in twice else 3) + (core if t.recompute == "selective" else 0)
    if st.last:
        total += 4 * 2 * n * m.padded_vocab_size * h / T
    return total


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
