"""The planner's expert all-to-alls with --overlap-moe-expert-parallel-comm: the forward of
micro-batch i+1 runs with the backward of micro-batch i, so each micro-batch's all-to-alls
travel under the other's compute and a step waits only for what outlasts it, plus the first
forward's and the last backward's, which have nothing to hide under
(``planning.estimate.exposed_ep``). (The runtime's overlap: tests/moe/test_a2a_overlap.py.)"""

from __future__ import annotations

import pytest

from megatron_p2r.arguments import config_from_values
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.pipeline.order import combined_warmup
from megatron_p2r.planning import estimate, hardware
from megatron_p2r.planning.activations import activation_memory

GPU = hardware.GPU_PRESETS["A100-80GB"]
MOE = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=1000,
    micro_batch_size=1,
    global_batch_size=64,
    mock_data=True,
    bf16=True,
    num_experts=16,
    moe_ffn_hidden_size=512,
    moe_router_topk=2,
    expert_model_parallel_size=16,
)


def test_exposed_ep_is_what_outlasts_the_other_microbatch_plus_the_ends():
    # 4 micro-batches, all-to-alls of 1 s (0.5 forward, 0.5 backward), compute 3 s (1 forward, 2 backward):
    # 3 pairs hide all; the first forward's 0.5 and the last backward's 0.5 are exposed: 1 s over 4
    assert estimate.exposed_ep(1.0, 3.0, 4) == pytest.approx(0.25)
    # 6 s: 3 under a backward of 2 (1 exposed) and 3 under a forward of 1 (2 exposed) per pair;
    # (6 + 2 x 3) / 3 micro-batches
    assert estimate.exposed_ep(6.0, 3.0, 3) == pytest.approx(4.0)
    assert estimate.exposed_ep(5.0, 3.0, 1) == 5.0  # one micro-batch: nothing to pair with
    assert estimate.exposed_ep(0.0, 3.0, 8) == 0.0


def test_overlap_hides_the_expert_all_to_alls_in_the_step():
    off, on = (
        estimate.make_plan(config_from_values({**MOE, "overlap_moe_expert_parallel_comm": flag}), 16, GPU)
        for flag in (False, True)
    )
    (before,), (after,) = off.stages, on.stages
    t = before.time_s
    assert t["ep_per_microbatch"] > 0 and "ep_hidden_per_microbatch" not in t
    window = t["compute_per_microbatch"] + t["tp_per_microbatch"]
    hidden = t["ep_per_microbatch"] - estimate.exposed_ep(t["ep_per_microbatch"], window, off.microbatches)
    assert after.time_s["ep_hidden_per_microbatch"] == pytest.approx(hidden) and hidden > 0
    assert {k: v for k, v in after.time_s.items() if k != "ep_hidden_per_microbatch"} == t
    saved = off.step_breakdown_s["pipeline"] - on.step_breakdown_s["pipeline"]
    assert saved == pytest.approx(off.microbatches * hidden)


def test_recomputed_backward_hides_the_forward_all_to_alls_under_more_compute():
    # every layer recomputed: forward 1 of compute 4, backward 3 (its recomputed forward included);
    # all-to-alls of 4 s: 2 under the other's backward (hidden), 2 under its forward (1 exposed);
    # 2 micro-batches: (4 + 1) / 2
    assert estimate.exposed_ep(4.0, 4.0, 2, recomputed=1.0) == pytest.approx(2.5)
    # none recomputed: forward 4/3, backward 8/3: (4 + 2/3) / 2
    assert estimate.exposed_ep(4.0, 4.0, 2) == pytest.approx(7 / 3)


def test_overlap_with_full_recomputation_communicates_no_all_to_all_again():
    """The serial schedule recomputes a layer with its all-to-alls (three passes of them); the
    overlapped one recomputes it node by node and keeps their results (two passes)."""
    # experts wide enough that half the all-to-alls outlast a forward but not a backward
    full = dict(
        MOE, moe_ffn_hidden_size=1024, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    off, on = (
        estimate.make_plan(config_from_values({**full, "overlap_moe_expert_parallel_comm": flag}), 16, GPU)
        for flag in (False, True)
    )
    (before,), (after,) = off.stages, on.stages
    assert after.comm_bytes["ep"] == pytest.approx(before.comm_bytes["ep"] * 2 / 3)
    t = after.time_s
    window = t["compute_per_microbatch"] + t["tp_per_microbatch"]
    exposed = estimate.exposed_ep(t["ep_per_microbatch"], window, on.microbatches, recomputed=1.0)
    assert t["ep_hidden_per_microbatch"] == pytest.approx(t["ep_per_microbatch"] - exposed)
    assert exposed != pytest.approx(estimate.exposed_ep(t["ep_per_microbatch"], window, on.microbatches))
    assert t["compute_per_microbatch"] == before.time_s["compute_per_microbatch"]


def test_under_pipeline_parallelism_the_combined_warmup_is_held_and_exposed():
    """PP=2 (the combined 1F1B schedule, ``order.combined_steps``): stage p holds min(2(P-p)-1, m)
    micro-batches in flight (1F1B: P-p), and its 2(P-p-1)+1 warm-up forwards and as many
    cool-down backwards expose their all-to-alls; the bubble stays 1F1B's."""
    pp2 = {**MOE, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 8}
    cfgs = [config_from_values({**pp2, "overlap_moe_expert_parallel_comm": flag}) for flag in (False, True)]
    off, on = (estimate.make_plan(cfg, 16, GPU) for cfg in cfgs)
    assert [s.in_flight for s in off.stages] == [2, 1] and [s.in_flight for s in on.stages] == [3, 1]
    plan = ParallelPlan.for_world(cfgs[1], 16)
    for stage in range(2):
        memory = activation_memory(cfgs[1], plan, stage)
        assert memory["activations"] >= memory["in_flight"] * memory["held_per_microbatch"]
        t = off.stages[stage].time_s
        window = t["compute_per_microbatch"] + t["tp_per_microbatch"]
        unpaired = combined_warmup(2, 1, off.microbatches, stage)
        hidden = t["ep_per_microbatch"] - estimate.exposed_ep(
            t["ep_per_microbatch"], window, off.microbatches, unpaired
        )
        assert on.stages[stage].time_s["ep_hidden_per_microbatch"] == pytest.approx(hidden) and hidden > 0
    assert on.stages[0].device["activations"] > off.stages[0].device["activations"]
    assert [combined_warmup(2, 1, off.microbatches, s) for s in range(2)] == [3, 1]
    assert on.pipeline_bubble == pytest.approx(off.pipeline_bubble)
    assert estimate.exposed_ep(1.0, 3.0, 4, unpaired=3) == pytest.approx(0.75)  # 3 unpaired pairs' worth of 1 s


def test_interleaved_holds_and_exposes_the_combined_warmup_in_chunk_forwards():
    """v = 2: rank p warms up with 2(P-p-1) + (v-1)P + 1 chunk forwards, held in flight (each
    half the stage's layers) and unpaired (half a micro-batch's all-to-alls each)."""
    values = {
        **MOE,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 8,
        "num_layers_per_virtual_pipeline_stage": 1,
        "overlap_p2p_communication": False,
    }
    off, on = (
        estimate.make_plan(config_from_values({**values, "overlap_moe_expert_parallel_comm": flag}), 16, GPU)
        for flag in (False, True)
    )
    warmups = [combined_warmup(2, 2, off.microbatches, s) for s in range(2)]
    assert warmups == [5, 3] and [s.in_flight for s in on.stages] == warmups
    for stage in range(2):
        t = off.stages[stage].time_s
        window = t["compute_per_microbatch"] + t["tp_per_microbatch"]
        hidden = t["ep_per_microbatch"] - estimate.exposed_ep(
            t["ep_per_microbatch"], window, off.microbatches, warmups[stage] / 2
        )
        assert on.stages[stage].time_s["ep_hidden_per_microbatch"] == pytest.approx(hidden) and hidden > 0
    assert on.pipeline_bubble == pytest.approx(off.pipeline_bubble)
