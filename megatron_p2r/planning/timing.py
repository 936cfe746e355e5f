"""Time on paper: FLOPs per micro-batch of a stage and the time a link takes for a volume."""

from __future__ import annotations

from typing import Sequence

from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.activations import moe_rows, recomputed_positions
from megatron_p2r.planning.communication import GroupTraffic
from megatron_p2r.planning.hardware import GPUSpec


def stage_flops_per_microbatch(cfg: Config, plan: ParallelPlan, stage: int, offloaded: Sequence[int] = ()) -> float:
    """Training FLOPs one rank of ``stage`` computes per micro-batch: 3x the forward matmuls
    (one more forward for layers recomputed in full, one more attention core under selective
    recomputation), the same convention as ``metrics.model_flops_per_token``; the loss
    recomputes its logits in backward (``parallel/cross_entropy.py``): 4x the output layer.
    Key/value heads replicated over TP (TP > query groups) are computed on every replica. Experts
    multiply the kept rows of balanced routing (``moe_rows``: exact with --moe-grouped-gemm,
    dropless; the padded experts multiply padding rows too when routing is imbalanced). The last
    stage's MTP depths: a layer of the last layer's kind, the 2h -> h projection and the output
    layer each."""
    m, t = cfg.model, cfg.train
    n, h, T = t.micro_batch_size * m.seq_length, m.hidden_size, plan.layout.tp
    st = plan.stage(stage)
    twice = recomputed_positions(cfg, st, offloaded)
    core = 4 * n * m.seq_length * m.num_attention_heads * m.head_dim / T
    total = 0.0
    for position, key in enumerate(st.layer_keys):
        fwd = _layer_forward_flops(cfg, plan, key, n)
        total += fwd * (4 if position in twice else 3) + (core if t.recompute == "selective" else 0)
    if st.last:
        depths = m.mtp_num_layers or 0  # multi-token prediction (model/mtp.py): never recomputed
        total += 4 * 2 * n * m.padded_vocab_size * h / T * (1 + depths)
        total += depths * 3 * (_layer_forward_flops(cfg, plan, m.num_layers - 1, n) + 2 * n * 2 * h * h / T)
    return total


def _layer_forward_flops(cfg: Config, plan: ParallelPlan, key: int, n: int) -> float:
    """The forward FLOPs of transformer layer ``key`` (its kind) on ``n`` tokens, one TP rank's."""
    m, h, T = cfg.model, cfg.model.hidden_size, plan.layout.tp
    glu = 2 if m.gated_linear_unit else 1
    heads = m.num_attention_heads * m.head_dim / T  # query (and output) rows on a rank
    kv = 2 * m.query_groups * m.head_dim / min(T, m.query_groups)  # key/value rows on a rank
    fwd = 2 * n * h * (2 * heads + kv) + 4 * n * m.seq_length * heads
    if m.is_moe_layer(key):
        _, rows = moe_rows(cfg, n)
        router = 2 * n * m.num_experts * h / (T if plan.sequence_parallel else 1)
        return fwd + router + 2 * rows * (glu + 1) * m.expert_ffn_size * h / T
    return fwd + 2 * n * (glu + 1) * m.ffn_size * h / T


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
