"""--overlap-moe-expert-parallel-comm (pipeline/a2a_overlap.py) reproduces the serial schedule
bitwise under EP=2 (2 gloo ranks, 3 micro-batches per rank, 2 optimizer steps): losses, the
first step's reduced gradients and the weights after the steps; dropless and capacity with
drops, --overlap-grad-reduce with several buckets, tied embeddings and the pseudo phase's shared
layers (weights read by several nodes), fp16 weights with the loss scale, dense layers between
MoE ones, selective recomputation, DeepSeek-style routing with gated shared experts (a node of
their own, run while the dispatch is in flight); full recomputation (whole layers in the serial schedule, node
by node in the overlapped one) with dropout and router jitter, whose draws each recomputed node
replays; and TP=2 x EP=2 with sequence parallelism (4 ranks), also with full recomputation. And
the all-to-alls do overlap: two are in flight at once. What a micro-batch holds, recomputed
node by node or not (and in the serial schedule), is the planner's count. The flag's rules are checked on the config
(pipeline parallelism: tests/moe/test_a2a_pipelined.py)."""

from __future__ import annotations

import pytest

from megatron_p2r.config import ConfigError
from megatron_p2r.config.schedule import COMBINED, schedule_plan
from megatron_p2r.config.validation import validate
from tests.harness import run_distributed
from tests.moe import overlap_workers
from tests.moe.workers import moe_model


def assert_bitwise(ranks, case):
    for rank, res in enumerate(ranks):
        r = res[case]
        assert r["overlapped_losses"] == r["losses"], f"rank {rank}, {case}"
        assert not r["grads_differ"], f"rank {rank}, {case}: gradients differ: {r['grads_differ']}"
        assert not r["weights_differ"], (
            f"rank {rank}, {case}: weights differ by up to {r['moved']}: {r['weights_differ']}"
        )
        assert r["most_in_flight"] == 2, f"rank {rank}, {case}: {r['most_in_flight']} all-to-alls in flight at most"


@pytest.fixture(scope="module")
def world2():
    return run_distributed(overlap_workers.world2, 2, timeout=300)


@pytest.mark.parametrize(
    "case",
    [
        "dropless/tied",
        "capacity-drops/overlap-grad-reduce",
        "pseudo-shared/tied/overlap-grad-reduce",
        "fp16/loss-scale",
        "dense-and-moe/recompute-selective",
        "deepseek/shared-experts",
    ],
)
def test_overlapped_schedule_is_bitwise_the_serial_one(world2, case):
    assert_bitwise(world2, case)


@pytest.fixture(scope="module")
def world2_recompute():
    return run_distributed(overlap_workers.world2_recompute, 2, timeout=300)


@pytest.mark.parametrize(
    "case",
    [
        "full/dropless/tied",
        "full/capacity-drops/swiglu",
        "full/pseudo-shared/overlap-grad-reduce",
        "full/fp16/loss-scale",
        "full/prototypes",
        "block-2/dense-and-moe",
    ],
)
def test_recomputed_node_by_node_is_bitwise_the_serial_full_recomputation(world2_recompute, case):
    """Dropout and router jitter on: each recomputed node replays the draws of its forward."""
    assert_bitwise(world2_recompute, case)


@pytest.fixture(scope="module")
def held():
    return run_distributed(overlap_workers.held_after_forward, 2, timeout=300)


# What the planner leaves out, the same in every case: per MoE layer that keeps its activations
# the router's aux-loss terms (a [1, E] fp32 fraction and a scalar: 20 bytes here), and the
# loss's two scalars. A recomputed layer keeps neither.
UNCOUNTED = {"full": 8, "none": 4 * 20 + 8, "serial": 4 * 20 + 8}


def test_recomputed_nodes_keep_their_inputs_and_the_all_to_all_results_as_the_planner_counts(held):
    """After one micro-batch's overlapped forward with full recomputation, what is held for its
    backward is what ``planning.activations`` counts, to the byte but for a scalar: per MoE
    layer its nodes' inputs and both all-to-alls' results, not the nodes' activations nor the
    rows it sent -- under half of what the schedule keeps without recomputation here."""
    for rank, r in enumerate(held):
        full, none = r["full"], r["none"]
        assert full["held"] - full["planned"] == UNCOUNTED["full"], f"rank {rank}: {full}"
        assert full["held"] < none["held"] / 2, f"rank {rank}: {r}"


@pytest.mark.parametrize("case", ["none", "serial"])
def test_a_micro_batch_without_recomputation_holds_what_the_planner_counts(held, case):
    """Without recomputation a MoE layer cut at its all-to-alls keeps what the serial layer
    keeps: the rows of its all-to-alls, sent and received, are freed once read, as the serial
    layer frees them; the serial layer (the flag off) keeps what the planner counts (its
    unsorting saves only the permutation). Both to the byte but for the aux-loss scalars."""
    for rank, r in enumerate(held):
        assert r[case]["held"] - r[case]["planned"] == UNCOUNTED[case], f"rank {rank}: {r[case]}"
        assert r["none"]["held"] == r["serial"]["held"], f"rank {rank}: {r}"


def test_overlapped_schedule_is_bitwise_the_serial_one_under_tp_and_sequence_parallel():
    ranks = run_distributed(overlap_workers.world4, 4, timeout=300)
    for case in ("tp2/sequence-parallel", "tp2/sequence-parallel/full-recompute"):
        assert_bitwise(ranks, case)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(ep=1), "--expert-model-parallel-size > 1"),
        (dict(ep=2, pp=2, pipeline_schedule="gpipe"), "--pipeline-schedule 1f1b"),
        (
            dict(ep=2, pp=2, num_layers_per_virtual_pipeline_stage=1, overlap_p2p_communication=True),
            "--no-overlap-p2p-communication",
        ),
        (
            dict(ep=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            "--recompute-method uniform --recompute-num-layers 1 or --recompute-method block",
        ),
        (dict(ep=2, compile=True), "--compile"),
    ],
)
def test_flag_rules(overrides, expected):
    cfg = moe_model(**overrides)
    with pytest.raises(ConfigError, match=expected.replace("-", r"\-").replace(">", ".")):
        validate(cfg.replace(overlap_moe_expert_parallel_comm=True), world_size=4)


@pytest.mark.parametrize("method, layers", [("uniform", 1), ("block", 2)])
def test_full_recomputation_one_layer_per_unit_is_accepted(method, layers):
    cfg = moe_model(ep=2, recompute_granularity="full", recompute_method=method, recompute_num_layers=layers).replace(
        overlap_moe_expert_parallel_comm=True
    )
    validate(cfg, world_size=4)
    assert schedule_plan(cfg).kind == COMBINED  # the overlapped schedule, recomputing node by node


def test_gpipe_without_pipeline_parallelism_is_accepted_and_with_it_refused_under_ep2():
    """Issue 38: --pipeline-schedule picks among pipelines, so at PP = 1 (one stage: no pipeline to
    schedule, as in Megatron-LM) gpipe changes nothing and the overlap runs; at PP = 2 it is refused."""
    validate(moe_model(ep=2, pipeline_schedule="gpipe").replace(overlap_moe_expert_parallel_comm=True), world_size=4)
    with pytest.raises(ConfigError, match=r"needs \-\-pipeline\-schedule 1f1b \(have gpipe\)"):
        validate(
            moe_model(ep=2, pp=2, pipeline_schedule="gpipe").replace(overlap_moe_expert_parallel_comm=True),
            world_size=4,
        )


def test_pipeline_parallelism_is_allowed_with_1f1b():
    for cfg in (
        moe_model(ep=2, pp=2).replace(overlap_moe_expert_parallel_comm=True),
        moe_model(ep=2, pp=2, num_layers_per_virtual_pipeline_stage=1, overlap_p2p_communication=False).replace(
            overlap_moe_expert_parallel_comm=True
        ),
    ):
        validate(cfg, world_size=4)
        plan = schedule_plan(cfg)
        assert (plan.kind, plan.stages, plan.posts_receives_ahead) == (COMBINED, 2, False)
