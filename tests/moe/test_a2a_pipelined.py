"""--overlap-moe-expert-parallel-comm under pipeline parallelism (pipeline/a2a_pipelined.py, the
combined 1F1B schedule) reproduces the serial 1F1B schedule bitwise under PP=2 x EP=2 (4 gloo
ranks, 6 micro-batches per rank, 2 optimizer steps): losses, the first step's reduced gradients
and the weights after the steps, and the data-parallel hooks see every backward start;
dropless with dropout (random draws in micro-batch order) and tied embeddings across the
stages, capacity with drops, untied, and --overlap-grad-reduce, the pseudo phase's shared
layers, fp16 weights with the loss scale, a dense and a MoE layer per stage with selective
recomputation, full recomputation (node by node against whole layers) with every random
draw on, and 2 micro-batches (fewer than stage 0's 3 warm-up forwards). Every rank that
has paired steps has two all-to-alls in flight at once. What one micro-batch's forward holds on
each stage, recomputed node by node or not, is the planner's count.
(The order itself: tests/pipeline/test_combined_order.py.)"""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.moe import overlap_workers


@pytest.fixture(scope="module")
def pp2_world4():
    return run_distributed(overlap_workers.pp2_world4, 4, timeout=600)


@pytest.mark.parametrize(
    "case",
    [
        "dropless/tied/dropout",
        "capacity-drops/untied/overlap-grad-reduce",
        "pseudo-shared/tied",
        "fp16/loss-scale",
        "dense-and-moe/recompute-selective",
        "2-microbatches",
        "full-recompute/dropless/tied/draws",
        "interleaved/dropless/tied/dropout",
        "interleaved/pseudo-shared/overlap-grad-reduce",
    ],
)
def test_combined_schedule_is_bitwise_the_serial_1f1b(pp2_world4, case):
    for rank, res in enumerate(pp2_world4):
        r = res[case]
        assert r["overlapped_losses"] == r["losses"], f"rank {rank}"
        assert not r["grads_differ"], f"rank {rank}: gradients differ: {r['grads_differ']}"
        assert not r["weights_differ"], f"rank {rank}: weights differ by up to {r['moved']}: {r['weights_differ']}"
        # ranks 0 and 1 are stage 0: with 2 micro-batches its 3 warm-up forwards leave nothing to pair
        paired = case != "2-microbatches" or rank >= 2
        assert r["most_in_flight"] == (2 if paired else 1), f"rank {rank}: {r['most_in_flight']} in flight at most"


@pytest.fixture(scope="module")
def pp2_held():
    return run_distributed(overlap_workers.pp2_held_after_forward, 4, timeout=300)


@pytest.mark.parametrize("case", ["full", "none"])
def test_a_stage_holds_what_the_planner_counts(pp2_held, case):
    """One micro-batch's forward on each stage (from the received activation on stage 1, its sent
    output freed on stage 0) leaves for its backward what ``planning.activations`` counts for
    the stage, with the MoE layers recomputed node by node or not; but for scalars (the freed
    output's one-element stand-in on stage 0, the loss's two on stage 1) and, per MoE layer
    keeping its activations, the router's aux-loss [1, E] fraction and scalar (20 bytes here)."""
    for rank, r in enumerate(pp2_held):
        stage = rank // 2
        uncounted = (8 if stage else 4) + (2 * 20 if case == "none" else 0)
        assert r[case]["held"] - r[case]["planned"] == uncounted, f"rank {rank} (stage {stage}): {r[case]}"
