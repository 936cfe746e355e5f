"""The distributed optimizer and overlapped reduction on gloo ranks against one process: DP2/DP4
with and without overlap, TP2 x DP2 (also with sequence parallelism), PP2 x DP2 in the pseudo
phase (also interleaved), MoE EP2 x expert-DP2, offload, 4 micro-batches; checkpoints across
DP sizes and optimizers, bitwise resume, delinking.

Tolerances are the existing DP tests' (tests/training/test_training.py): losses 1e-5 relative, weights
1e-4 absolute after 3 steps at lr 1e-2 (the order of the reductions differs from one process;
Adam divides by sqrt(v), so elements with tiny gradients amplify that rounding).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import build_datasets, build_train_state, evaluate
from megatron_p2r.checkpoint.io import load_checkpoint
from tests.helpers import run_steps
from tests.optim.common import DISTOPT, OVERLAP, cfg
from tests.optim.workers import equivalence_cases, two_ranks

PSEUDO = dict(num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2")
MOE = dict(num_experts=4, moe_layer_freq=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01)
FOUR_RANKS = {
    "dp4": DISTOPT,
    "dp4-overlap": OVERLAP,
    "dp4-overlap-4-microbatches": dict(global_batch_size=32, **OVERLAP),
    "tp2-dp2": dict(tensor_model_parallel_size=2, **OVERLAP),
    # norms and biases on sequence shards: partial over TP, in their own "TP x DP" buffer
    "tp2-sp-dp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, **OVERLAP),
    "pp2-dp2-pseudo-cycle2": dict(pipeline_model_parallel_size=2, **PSEUDO, **OVERLAP),  # slots + tied embedding
    # interleaved 1F1B: each rank's two chunks call one pseudo slot, final in chunk 0's last backward
    "pp2-dp2-interleaved-pseudo-cycle2": dict(
        pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, **PSEUDO, **OVERLAP
    ),
    "ep2-expert-dp2-moe": dict(expert_model_parallel_size=2, **MOE, **OVERLAP),
    "dp4-offload": dict(cpu_offload_layers="1", **OVERLAP),
    "pp2-dp2-pseudo-offload": dict(pipeline_model_parallel_size=2, cpu_offload_layers="1", **PSEUDO, **OVERLAP),
    "dp4-offload-optimizer-only": dict(cpu_offload_layers="1", cpu_offload_what="optimizer", **OVERLAP),
    # the lean optimizers across TP (Lion: elementwise, so exact; Adafactor factors each TP shard
    # on its own, docs/scale.md) and pipeline stages with offload. No linear biases for Lion: the
    # key bias's gradient is zero up to rounding, whose sign Lion steps by the full learning rate
    "tp2-dp2-lion": dict(tensor_model_parallel_size=2, optimizer="lion", disable_bias_linear=True, **OVERLAP),
    "pp2-dp2-pseudo-offload-adafactor": dict(
        pipeline_model_parallel_size=2, cpu_offload_layers="1", optimizer="adafactor", **PSEUDO, **OVERLAP
    ),
}
TWO_RANKS = {
    "dp2": DISTOPT,
    "dp2-overlap": OVERLAP,
    # the memory-lean optimizers: Adafactor's statistics of matrices cut between the ranks are summed
    # over both; with fp16 loss scaling and a host-resident layer (its optimizer steps on host).
    # Lion without linear biases (the key bias: "tp2-dp2-lion")
    "dp2-lion": dict(optimizer="lion", disable_bias_linear=True, **OVERLAP),
    "dp2-adafactor": dict(optimizer="adafactor", **OVERLAP),
    "dp2-lion-fp16-offload": dict(
        optimizer="lion", fp16=True, cpu_offload_layers="1", disable_bias_linear=True, **OVERLAP
    ),
    "dp2-adafactor-fp16-offload": dict(optimizer="adafactor", fp16=True, cpu_offload_layers="1", **OVERLAP),
    "dp2-adafactor-offload-optimizer-only": dict(
        optimizer="adafactor", cpu_offload_layers="1", cpu_offload_what="optimizer", **OVERLAP
    ),
}
# Resume: warm-up, cosine decay, clipping (the norm over shards) and weight decay.
RESUME = dict(lr_warmup_iters=1, lr_decay_style="cosine", clip_grad=1.0, weight_decay=0.01, train_iters=4)


def _check_cases(results, cases):
    for rank, res in enumerate(results):
        for label in cases:
            r = res[label]
            assert r["sharded"], label
            assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), (label, rank, r)
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (label, rank, r)
            assert r["weight_err"] < 1e-4, (label, rank, r["weight_err"])


def test_four_ranks_reproduce_one_process():
    _check_cases(run_distributed(equivalence_cases, 4, FOUR_RANKS, timeout=600), FOUR_RANKS)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """The one-process run (4 steps, saved after 2 without the distributed optimizer), then one
    2-rank spawn: the DP2 equivalence cases, the staged collectives and the checkpoint runs."""
    root = str(tmp_path_factory.mktemp("distopt"))
    c = cfg(**RESUME)

    def save_after_2(state) -> None:
        if state.iteration == 2:
            save_checkpoint(os.path.join(root, "dp1"), state)

    dp1, _ = run_steps(c, ParallelState.single(), 4, after_step=save_after_2)
    results = run_distributed(two_ranks, 2, TWO_RANKS, root, {**RESUME, **OVERLAP}, {**PSEUDO, **OVERLAP}, timeout=600)
    return root, dp1, results


def test_two_ranks_reproduce_one_process(two_rank_run):
    _check_cases([r["cases"] for r in two_rank_run[2]], TWO_RANKS)


def test_staged_collectives_equal_the_plain_ones(two_rank_run):
    """Host-resident buckets reduce through a bounded device buffer: here 7 elements for 80, so
    every collective is chunked (and chunks alike on both members)."""
    for r in two_rank_run[2]:
        assert r["staged"] == {"all_reduce": True, "reduce_scatter": True, "all_gather": True}


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(two_rank_run):
    """fp16: a NaN in one rank's gradient shard makes every rank skip, halve the loss scale and
    keep its weights (the non-finite flag is reduced over the world before anyone steps)."""
    assert [r["skip"] for r in two_rank_run[2]] == [{"skipped": True, "scale": 512.0, "unchanged": True}] * 2


def test_resume_with_the_distributed_optimizer_is_bitwise(two_rank_run):
    for r in (x["checkpoints"] for x in two_rank_run[2]):
        assert r["sharded"] and r["resumed"] == r["whole"][2:] and r["resumed_hash"] == r["whole_hash"]


def test_lean_optimizers_resume_bitwise_and_on_one_process(two_rank_run):
    """Lion and Adafactor on DP2 with the distributed optimizer: resuming the checkpoint saved
    after 2 of 4 steps gives the same last 2 steps bitwise; loaded on one process without the
    distributed optimizer (statistics gathered whole, then kept whole) it continues alike; an
    AdamW checkpoint loads into Adafactor on DP2 as on one process."""
    root, _, results = two_rank_run
    for optimizer in ("lion", "adafactor"):
        for r in (x["lean"][optimizer] for x in results):
            assert r["resumed"] == r["whole"][2:] and r["resumed_hash"] == r["whole_hash"], optimizer
        continued, _ = run_steps(
            cfg(optimizer=optimizer, **RESUME), ParallelState.single(), 2, load=os.path.join(root, optimizer)
        )
        assert continued == pytest.approx(results[0]["lean"][optimizer]["whole"][2:], rel=1e-5), optimizer
    from_adam, _ = run_steps(
        cfg(optimizer="adafactor", **RESUME), ParallelState.single(), 2, load=os.path.join(root, "dp1")
    )
    for r in results:  # AdamW's checkpoint into Adafactor on DP2 with the distributed optimizer, as on one process
        assert r["lean"]["adafactor"]["from_adam"] == pytest.approx(from_adam, rel=1e-5)


def test_checkpoints_move_between_dp_sizes_and_optimizers(two_rank_run):
    """Saved on one process without the distributed optimizer, continued on DP2 with it; saved on
    DP2 with it, continued on one process without it: each continuation is the uninterrupted run."""
    root, dp1, results = two_rank_run
    for r in (x["checkpoints"] for x in results):
        assert r["whole"] == pytest.approx(dp1, rel=1e-5)
        assert r["from_dp1"] == pytest.approx(dp1[2:], rel=1e-5)
    continued, _ = run_steps(cfg(**RESUME), ParallelState.single(), 2, load=os.path.join(root, "dp2"))
    assert continued == pytest.approx(dp1[2:], rel=1e-5)
    assert continued == pytest.approx(results[0]["checkpoints"]["whole"][2:], rel=1e-5)


def test_delink_of_a_distributed_optimizer_checkpoint(two_rank_run, tmp_path):
    """A pseudo-phase checkpoint saved on DP2 with the distributed optimizer delinks like any
    other: the real model on one process has the pseudo model's eval loss, and carries the
    moments (copied per slot)."""
    root, _, results = two_rank_run
    convert(
        os.path.join(root, "pseudo"),
        str(tmp_path / "real"),
        Target(),
        DelinkOptions(optimizer_state="copy"),
        progress=False,
    )
    real_cfg = cfg(**{**PSEUDO, "p2r_phase": "real"})
    state = build_train_state(real_cfg, ParallelState.single())
    load_checkpoint(str(tmp_path / "real"), state)
    _, valid = build_datasets(real_cfg, state.ps)
    assert evaluate(state, valid) == pytest.approx(results[0]["checkpoints"]["pseudo_eval"], rel=1e-5)
    assert state.optimizer.step_count == 2
    slot = state.optimizer.state[state.model.get_parameter("layers.2.mlp.fc1.weight")]["exp_avg"]
    assert torch.equal(slot, state.optimizer.state[state.model.get_parameter("layers.0.mlp.fc1.weight")]["exp_avg"])
