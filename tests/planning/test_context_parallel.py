"""The planner under context parallelism: the activation bytes of a CP rank against what a CP2
step allocates on gloo (every module on s/CP tokens plus what each --cp-comm-type's core keeps),
the ring's traffic and exposure, the sequence-length step, and meta builds of CP layouts."""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.config import ConfigError
from megatron_p2r.context.chunks import split_batch
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning import activations, communication, memory, timing
from megatron_p2r.planning.longest_sequence import sequence_step
from tests.harness import run_distributed
from tests.planning.test_planner import ACT_SHAPES, MOE, measure_step, small
from tools.plan import check, verify_all_ranks, verify_rank

ROPE_GQA = dict(
    position_embedding_type="rope", group_query_attention=True, num_query_groups=2, normalization="RMSNorm", swiglu=True
)
CP_CASES = {
    "p2p": dict(),
    "allgather": dict(cp_comm_type="allgather"),
    "allgather-rope-gqa": dict(cp_comm_type="allgather", **ROPE_GQA),
    "a2a-rope-gqa": dict(cp_comm_type="a2a", **ROPE_GQA),
    "allgather-selective": dict(cp_comm_type="allgather", recompute_granularity="selective", **ROPE_GQA),
    # MoE on the rank's tokens, experts over DP x CP (capacity 0.25: every expert fills it)
    "p2p-moe-ep2": dict(moe_capacity_factor=0.25, moe_layer_freq=2, expert_model_parallel_size=2, **MOE),
}


def cp_activation_worker(rank, world):
    """One forward/backward of a CP2 model per case on this rank's chunks, with the planner's figure."""
    from megatron_p2r.model.m6 import build_model
    from megatron_p2r.parallel.random import seed_everything
    from megatron_p2r.parallel.state import initialize_plan
    from tests.helpers import random_microbatches

    out = {}
    for name, overrides in CP_CASES.items():
        cfg = small(**ACT_SHAPES, bf16=True, context_parallel_size=2, **overrides)
        plan = ParallelPlan.for_world(cfg, world)
        ps = initialize_plan(plan, torch.device("cpu"))
        seed_everything(3, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps, plan)
        mb = split_batch(random_microbatches(cfg, 1, cfg.train.micro_batch_size)[0], 2, ps.cp_rank)

        def step(tracker, model=model, mb=mb):
            loss = model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"])
            held = tracker.held()
            loss.backward()
            return held

        held, peak = measure_step(model, cfg, step, [mb])
        out[name] = dict(held=held, peak=peak, est=activations.activation_memory(cfg, plan, 0, device_type="cpu"))
    return out


def test_cp_rank_holds_what_the_planner_counts():
    """Held bytes within 1% (observed: exact to 4 B with rope; learned positions 4.6 KB, 0.2%, under
    whatever the comm type: not the core); peak within 10% (the backward's working set is modelled,
    not replayed), as for the other layouts in test_planner.py."""
    for rank, results in enumerate(run_distributed(cp_activation_worker, 2, timeout=300)):
        for name, r in results.items():
            est = r["est"]
            assert abs(est["activations"] / r["held"] - 1) < 0.01, (name, rank, est["activations"], r["held"])
            assert abs((est["activations"] + est["transient"]) / r["peak"] - 1) < 0.10, (name, rank, est, r["peak"])


GQA = dict(group_query_attention=True, num_query_groups=2, position_embedding_type="rope", bf16=True)


def test_ring_traffic_moves_only_the_key_value_heads():
    """p2p on CP2 x TP2, 4 query and 2 KV heads: each layer sends this TP rank's one KV head of its
    s/CP tokens, K and V, N-1 hops forward (16-bit) and N-1 hops of KV plus N of fp32 dK, dV back."""
    cfg = small(seq_length=64, context_parallel_size=2, tensor_model_parallel_size=2, **GQA)
    plan = ParallelPlan.for_world(cfg, 4)
    traffic = communication.communication(cfg, plan, 0)["cp"]
    b, local, d, kv_heads, n = 2, 32, 16, 1, 2
    kv = 2 * b * kv_heads * local * d
    per_layer = (n - 1) * kv * 2 + (n - 1) * kv * 2 + n * kv * 4
    mbs = cfg.train.global_batch_size // b if cfg.train.global_batch_size else 1
    assert traffic.bytes == mbs * cfg.model.num_layers * per_layer
    assert traffic.size == 2 and traffic.nodes == 1  # CP ranks next to the TP ranks: one node
    tp8 = small(seq_length=64, context_parallel_size=2, tensor_model_parallel_size=8, num_attention_heads=8, **GQA)
    assert communication.communication(tp8, ParallelPlan.for_world(tp8, 16), 0)["cp"].nodes == 2  # over the network


def test_gradients_and_optimizer_shard_over_dp_times_cp_and_flops_split_over_cp():
    """CP2 x DP2 reduces gradients and shards the distributed optimizer over 4 replicas, as DP4
    does; a CP2 rank computes half a CP1 rank's FLOPs (matmuls on s/2 tokens, the balanced half
    of the causal core)."""
    base = dict(seq_length=64, use_distributed_optimizer=True, global_batch_size=8)
    cp = ParallelPlan.for_world(small(context_parallel_size=2, **base), 4)
    dp = ParallelPlan.for_world(small(**base), 4)
    assert memory.stage_state_bytes(cp, 0) == memory.stage_state_bytes(dp, 0)
    assert communication.gradient_traffic(cp, 0)["dp"].size == 4
    one = ParallelPlan.for_world(small(**base), 1)
    flops = timing.stage_flops_per_microbatch
    cp_cfg = small(context_parallel_size=2, **base)
    assert flops(cp_cfg, cp, 0) == flops(small(**base), one, 0) / 2


def test_p2p_hides_behind_the_blocks_and_allgather_does_not():
    cfg = small(seq_length=64, context_parallel_size=4)
    plan = ParallelPlan.for_world(cfg, 4)
    assert timing.exposed_context(cfg, plan, 1.0, 2.0) == 0.0
    assert timing.exposed_context(cfg, plan, 1.0, 0.8) == 1.0 - 0.8 * 3 / 4
    ag = cfg.replace(cp_comm_type="allgather")
    assert timing.exposed_context(ag, ParallelPlan.for_world(ag, 4), 1.0, 2.0) == 1.0


def test_length_step_is_2cp_chunks_and_tp_under_sequence_parallelism():
    cfg = small(context_parallel_size=4)
    assert sequence_step(cfg, 256) == 256 and sequence_step(cfg, 1) == 8
    assert sequence_step(cfg.replace(tensor_model_parallel_size=2, sequence_parallel=True), 1) == 16


def test_cp_layouts_verify_on_meta_builds():
    """Parameters are replicated over CP as over DP: every rank class of CP2 x TP2, CP2 x DP2 and
    CP2 x PP2 builds what the planner lists."""
    layouts = (
        (4, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (4, {}),
        (4, dict(pipeline_model_parallel_size=2, num_layers=4)),
    )
    for world, overrides in layouts:
        cfg = small(seq_length=64, context_parallel_size=2, **GQA, **overrides)
        assert verify_all_ranks(cfg, world)["problems"] == []
        assert verify_rank(cfg, world, world - 1)["problems"] == []


def test_planner_refuses_what_cp_does_not_compose_with():
    """The training's refusals (config.validate), by name (MoE under SP with TP above 1 composes
    with CP since the router's statistics are summed over TP x CP: planned)."""
    moe_sp = dict(tensor_model_parallel_size=2, sequence_parallel=True, **MOE)
    check(small(seq_length=64, context_parallel_size=2, **moe_sp), 4)
    with pytest.raises(ConfigError, match="not built with --compile"):
        check(small(seq_length=64, context_parallel_size=2, compile=True), 2)
    # and what the attention refuses at its first forward: a2a over heads the CP size does not divide
    a2a = small(seq_length=64, context_parallel_size=4, cp_comm_type="a2a", **GQA)  # 2 KV heads over 4
    with pytest.raises(ConfigError, match="--cp-comm-type a2a: 4 local attention heads and 2 local key/value"):
        check(a2a, 4)
    check(a2a.replace(cp_comm_type="p2p"), 4)


@pytest.mark.slow
def test_the_guide_shows_what_the_planner_prints(capsys):
    """docs/scale.md's "Context parallelism in the plan": the table is what
    benchmarks/context_parallel_plan.py prints, the longest-sequence line what its command prints."""
    import importlib.util

    from tools.plan import main

    with open("docs/scale.md", encoding="utf-8") as fh:
        text = fh.read()
    shape = text.split('L3="', 1)[1].split('"', 1)[0].split()
    section = text[text.index("## Context parallelism in the plan") : text.index("## What it refuses")]
    spec = importlib.util.spec_from_file_location("cp_table", "benchmarks/context_parallel_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows == bench.table()
    command = next(line.split()[2:] for line in section.splitlines() if line.startswith("p2r-plan $L3 "))
    quoted = [line for line in section.splitlines() if line.startswith("longest sequence ")]
    capsys.readouterr()
    assert main(shape + command) == 0 and len(quoted) == 1
    assert quoted[0] in capsys.readouterr().out.splitlines()
