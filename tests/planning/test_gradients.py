"""The planner's gradient and optimizer side: bytes per parameter with 16-bit weights and the
distributed optimizer, reduce-scatter + all-gather traffic, the ring all-reduce over nodes, the
overlap of the reduction with backward, and Megatron-LM's own formula on its published
configurations. (Measured against real tensors in tests/optim/test_mixed_precision.py.)"""

from __future__ import annotations

import importlib.util
import os

import pytest

from megatron_p2r.arguments import config_from_values
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning import communication, estimate, hardware, memory, timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=1000,
    micro_batch_size=1,
    mock_data=True,
)


def small(**kw):
    return config_from_values({**SMALL, **kw})


def _per_param(cfg, world) -> float:
    plan = ParallelPlan.for_world(cfg, world)
    state = memory.stage_state_bytes(plan, 0)
    return sum(state[c] for c in ("params", "grads", "optimizer")) / sum(s.numel for s in plan.tensors(0))


@pytest.mark.parametrize(
    "flags,dp,want",
    [
        ({}, 1, 16),  # fp32 weights are the mains: 4 + 4 + 8
        (dict(bf16=True), 1, 18),  # 2 + 4 + (4 + 8): Megatron's 18
        (dict(bf16=True, use_distributed_optimizer=True), 8, 2 + 4 + 12 / 8),  # Megatron's 6 + 12/DP
        (dict(use_distributed_optimizer=True), 8, 4 + 4 + 8 / 8),
    ],
)
def test_bytes_per_parameter(flags, dp, want):
    assert _per_param(small(**flags), dp) == pytest.approx(want, rel=2e-3)  # bucket padding


def test_distributed_optimizer_traffic_is_reduce_scatter_plus_all_gather():
    cfg, dist_cfg = small(bf16=True), small(bf16=True, use_distributed_optimizer=True)
    n = sum(s.numel for s in ParallelPlan.for_world(cfg, 8).tensors(0))
    plain = communication.gradient_traffic(ParallelPlan.for_world(cfg, 8), 0)["dp"]
    sharded = communication.gradient_traffic(ParallelPlan.for_world(dist_cfg, 8), 0)["dp"]
    assert plain.bytes == pytest.approx(2 * 7 / 8 * 4 * n)  # ring all-reduce of fp32 gradients
    assert sharded.bytes == pytest.approx(7 / 8 * (4 + 2) * n)  # reduce-scatter fp32 + all-gather bf16


def test_a_ring_over_nodes_sends_one_members_bytes_per_node():
    """DP over 2 nodes of 8 GPUs: with TP 1 the 8 members of a node share its 8 NICs, so the
    all-reduce runs 8x faster than at TP 8 (one member per node: one NIC's share), and the
    same bytes are sent per rank."""
    gpu = hardware.GPU_PRESETS["A100-80GB"]
    tp1 = communication.gradient_traffic(ParallelPlan.for_world(small(), 16), 0)["dp"]
    tp8 = communication.gradient_traffic(ParallelPlan.for_world(small(tensor_model_parallel_size=4), 64), 0)["dp"]
    assert (tp1.nodes, tp1.per_node, tp8.nodes, tp8.per_node) == (2, 8, 8, 2)
    assert timing.link_time(tp1, gpu) == pytest.approx(tp1.bytes / (8 * gpu.inter_node_bw))
    assert timing.link_time(tp8, gpu) == pytest.approx(tp8.bytes / (2 * gpu.inter_node_bw))
    within = communication.gradient_traffic(ParallelPlan.for_world(small(), 8), 0)["dp"]
    assert within.nodes == 1 and timing.link_time(within, gpu) == pytest.approx(within.bytes / gpu.intra_node_bw)


def test_overlap_hides_the_reduction_under_backward():
    """Buckets of 1e5 elements of a 3.4e6-parameter stage: all but the last reduce while backward
    runs (the 40M default makes one bucket of this model, which reduces after backward)."""
    gpu = hardware.GPU_PRESETS["A100-80GB"]
    base = dict(
        bf16=True, use_distributed_optimizer=True, global_batch_size=128, seq_length=2048, micro_batch_size=4
    )  # a micro-batch's backward outlasts the reduction
    off = estimate.make_plan(small(**base), 32, gpu).step_breakdown_s["grad_sync"]
    on = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    one_bucket = estimate.make_plan(small(**base, **on), 32, gpu).step_breakdown_s["grad_sync"]
    buckets = estimate.make_plan(small(**base, **on, ddp_bucket_size=100_000), 32, gpu).step_breakdown_s["grad_sync"]
    assert one_bucket == off  # one bucket per buffer: final only when backward ends
    assert 0 < buckets < off / 2


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "memory_per_rank", os.path.join(ROOT, "benchmarks", "memory_per_rank.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("table,row", [("Megatron-LM README", "70B"), ("Narayanan", "145B")])
def test_rank_bytes_match_megatrons_formula_on_its_configurations(table, row):
    """The model Megatron-LM's formula counts (no biases, no learned positions), its layout: our
    most loaded stage holds what the formula says with 18 B per parameter, and no more than its
    6 + 12/DP with the distributed optimizer (the tied embedding's state is sharded over both of
    its stages x DP here)."""
    bench = _benchmark()
    rows, vocab, seq, _, activations, _ = next(v for k, v in bench.TABLES.items() if k.startswith(table))
    spec = next(r for r in rows if r[0] == row)
    _, _, hidden, layers, tp, pp, gpus, _ = spec
    for distributed in (False, True):
        plan = ParallelPlan.for_world(bench._gpt(*spec, vocab, seq, activations, distributed, False), gpus)
        ours = max(
            sum(memory.stage_state_bytes(plan, s)[c] for c in ("params", "grads", "optimizer")) for s in range(pp)
        )
        theirs = bench.megatron_weight_and_optimizer_bytes(
            hidden, layers, vocab, tp, pp, gpus // (tp * pp), distributed
        )
        assert ours <= theirs * (1 + 1e-5), (distributed, ours / theirs)  # the final norm: 2h on one stage
        assert ours >= theirs * 0.99
