"""GPipe and 1F1B reproduce the single-process run: loss and every gradient.

The ranks (``workers.py``) run each case and, in the same rank, the one-process reference on
the same micro-batches (which differ in batch size and sequence length, and mask ~20% of the
tokens); these tests assert on the errors they report.

Tolerances (fp32): loss and gradients within 1e-6 absolute of the reference (observed: 0 for
untied models, ~1.5e-8 where the tied embedding's two contributions are summed in another
order). GPipe and 1F1B back-propagate micro-batches in the same order, so their gradients
must be bitwise equal. The gradients compared are those training reduces and steps on: the
``main_grad`` of the DDP's gradient buffers (``pipeline/common.pipelined_step``).

16-bit weights (--bf16) + recompute, against the one-process model in bf16 whose micro-batch
gradients are summed in fp32 as the buffers sum them; errors relative to each tensor's largest
reference element. Untied: within FP32_TOL (observed 0: every micro-batch's gradient is computed
as on one process, only the fp32 sums are ordered differently). Tied: within BF16_REL (observed
2.9e-3 on the embedding only: one process adds the embedding's two uses in bf16 inside autograd,
PP=2 adds the two stages' fp32 gradients; every other tensor within 3e-8).
"""

from __future__ import annotations

import pytest

from megatron_p2r.config.schedule import COMBINED, GPIPE, INTERLEAVED, NO_PIPELINING, ONE_F_ONE_B, SchedulePlan
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.pipeline.a2a_pipelined import forward_backward_combined_1f1b
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining, get_forward_backward_func
from tests.pipeline.common import make_cfg, make_microbatches

FP32_TOL = 1e-6
BF16_REL = 1e-2


def check_equivalence(results: list, prefix: str, tol: float = FP32_TOL) -> int:
    """Across all ranks, for every case label starting with ``prefix``: errors within ``tol``,
    1F1B == GPipe bitwise, and every logical gradient of the model compared on some rank."""
    labels = [k for k in results[0]["equiv"] if k.startswith(prefix)]
    for label in labels:
        held = set()
        for rank, res in enumerate(results):
            r = res["equiv"][label]
            assert r["loss_err"] <= tol, f"{label} rank {rank}: loss differs by {r['loss_err']}"
            assert r["grad_err"] <= tol, f"{label} rank {rank}: gradient differs by {r['grad_err']}"
            if "same_as_gpipe" in r:
                assert r["same_as_gpipe"], f"{label} rank {rank}: 1F1B and GPipe gradients differ"
            held.update(r["names"])
        missing = set(results[0]["equiv"][label]["ref_names"]) ^ held
        assert not missing, f"{label}: gradients not compared: {missing}"
    return len(labels)


def test_pp4_reproduces_single_process_tied_untied_1f1b_gpipe(world4):
    assert check_equivalence(world4, "pp4/tied/m5/") == 2
    assert check_equivalence(world4, "pp4/untied/m5/") == 2
    assert all("same_as_gpipe" in r["equiv"]["pp4/untied/m5/1f1b"] for r in world4)


def test_pp2_reproduces_single_process_tied_untied_1f1b_gpipe(world4):  # with DP=2 on top
    assert check_equivalence(world4, "pp2dp2/tied/m3/") == 2
    assert check_equivalence(world4, "pp2dp2/untied/m3/") == 2


def test_fewer_microbatches_than_stages(world4):
    assert check_equivalence(world4, "pp4/tied/m2/") == 2
    assert check_equivalence(world4, "pp2dp2/tied/m1/") == 2


def test_uneven_layer_split(world4):
    assert check_equivalence(world4, "pp4/split2,1,1,1/") == 1
    assert check_equivalence(world4, "pp2dp2/split") == 2


def test_tp2_pp2_on_4_ranks(world4):
    assert check_equivalence(world4, "tp2pp2/") == 3


def test_tp2_pp2_dp2_on_8_ranks(world8):
    assert check_equivalence(world8, "tp2pp2dp2/") == 2


def same_as_twin(results: list, label: str) -> bool:
    """Whether the gradients of interleaved case ``label``, merged over all ranks, are bitwise
    those of its plain 1F1B twin (which holds each layer on another rank)."""

    def merged(case):
        return {k: h for r in results for k, h in r["equiv"][case]["hashes"].items()}

    return merged(label) == merged(label.replace("/interleaved", "/1f1b"))


def test_interleaved_reproduces_one_process_and_1f1b_bitwise(world4):
    """Two chunks per rank, P=4 (8 layers) and P=2 x DP=2 (4 layers), tied and untied, m a
    multiple of P, not one (P=2 m=5 and m=3: the remainder joins the last group; on P=2, m=5
    the receiver needs rank 1's messages in another order than it sends them) and below P
    (P=4 m=3): loss and every gradient as one process, and bitwise as 1F1B."""
    assert check_equivalence(world4, "pp4v2/tied/m5/") == 2 and check_equivalence(world4, "pp4v2/untied/m3/") == 2
    assert check_equivalence(world4, "pp2dp2v2/tied/m3/") == 2
    assert check_equivalence(world4, "pp2dp2v2/untied/m5/") == 2
    for label in ("pp4v2/tied/m5", "pp4v2/untied/m3", "pp2dp2v2/tied/m3", "pp2dp2v2/untied/m5"):
        assert same_as_twin(world4, f"{label}/interleaved"), label


def test_overlapped_reduction_inside_the_pipelined_backward(world4):
    """--overlap-grad-reduce with small buckets (interleaved 1F1B, P=2 x DP=2, tied): each
    bucket's all-reduce starts in the last micro-batch's backward of the chunk it belongs to;
    the gradients are the one-process ones and bitwise those reduced after the backward."""
    assert check_equivalence(world4, "pp2dp2v2/overlap/") == 1
    merged = {
        label: {k: h for r in world4 for k, h in r["equiv"][label]["hashes"].items()}
        for label in ("pp2dp2v2/overlap/m3/interleaved", "pp2dp2v2/tied/m3/interleaved")
    }
    assert merged["pp2dp2v2/overlap/m3/interleaved"] == merged["pp2dp2v2/tied/m3/interleaved"]


def _same_as_serial(results: list, overlapped: str, serial: str) -> bool:
    """Whether case ``overlapped`` has, on every rank, the loss and the main_grads of ``serial``, bitwise."""

    def merged(case):
        return {k: h for r in results for k, h in r["equiv"][case]["hashes"].items()}

    same_loss = all(r["equiv"][overlapped]["loss"] == r["equiv"][serial]["loss"] for r in results)
    return same_loss and merged(overlapped) == merged(serial)


def test_overlapped_p2p_reproduces_the_serial_schedules_bitwise(world4):
    """--overlap-p2p-communication posts each op's receives before the op ahead of it computes:
    interleaved P=2 x DP=2 with m=5 (rank 0 takes rank 1's messages out of the order it needs
    them), the same model under plain 1F1B and GPipe, and P=2 x EP=2 MoE interleaved: the loss
    and every main_grad bitwise those of the schedule that receives when it needs the input."""
    assert (
        check_equivalence(world4, "pp2dp2v2/p2p-overlap/") == 2
        and check_equivalence(world4, "pp2dp2/p2p-overlap/") == 1
    )
    for overlapped, serial in (
        ("pp2dp2v2/p2p-overlap/m5/interleaved", "pp2dp2v2/untied/m5/interleaved"),
        ("pp2dp2v2/p2p-overlap/m5/1f1b", "pp2dp2v2/untied/m5/1f1b"),
        ("pp2dp2/p2p-overlap/m3/gpipe", "pp2dp2/tied/m3/gpipe"),
    ):
        assert _same_as_serial(world4, overlapped, serial), (overlapped, serial)
    assert all(isinstance(r["moe"], dict) for r in world4), [r["moe"] for r in world4]
    moe = [{"equiv": r["moe"]} for r in world4]
    assert check_equivalence(moe, "pp2ep2v2/moe-p2p-overlap/") == 1
    assert _same_as_serial(moe, "pp2ep2v2/moe-p2p-overlap/m3/interleaved", "pp2ep2v2/moe/m3/interleaved")


def test_train_step_with_overlapped_p2p_trains_as_without(world4):
    """--overlap-p2p-communication through train_step (interleaved, PP=2 x DP=2, 3 AdamW steps):
    receives are posted ahead, and the losses and the weights after the steps are bitwise those
    of the run without it."""
    for r in world4:
        serial, overlapped = r["train_overlap"]["serial"], r["train_overlap"]["overlapped"]
        assert serial["posted"] == 0 and overlapped["posted"] > 0, r["train_overlap"]
        assert overlapped["losses"] == serial["losses"] and overlapped["weights"] == serial["weights"]


def test_interleaved_pseudo_phase_share_all(world4):
    """Every layer calls slot 0: two chunks of each rank call one module (local accumulation),
    whose gradient is then summed over all pipeline stages x DP."""
    assert check_equivalence(world4, "pp4v2/pseudo-all/") == 1
    assert check_equivalence(world4, "pp2dp2v2/pseudo-all/") == 1


def test_interleaved_composes_with_tp_and_moe_ep(world4):
    assert check_equivalence(world4, "tp2pp2v2/") == 2
    assert same_as_twin(world4, "tp2pp2v2/tied/m3/interleaved")
    assert all(isinstance(r["moe"], dict) for r in world4), [r["moe"] for r in world4]
    moe = [{"equiv": r["moe"]} for r in world4]
    assert check_equivalence(moe, "pp2ep2v2/moe/") == 2
    assert same_as_twin(moe, "pp2ep2v2/moe/m3/interleaved")


def test_moe_with_expert_parallelism_composes(world4):  # PP=2 x DP=2, EP=2, aux + z losses
    for r in world4:
        assert isinstance(r["moe"], dict), f"rank {r['rank']} failed:\n{r['moe']}"
    assert check_equivalence([{"equiv": r["moe"]} for r in world4], "pp2ep2/moe/") == 2


def test_recompute_and_bf16_compose(world4):
    assert check_equivalence(world4, "pp2dp2/recompute/") == 1
    for r in world4:
        untied, tied = r["bf16"]["bf16/untied"], r["bf16"]["bf16/tied"]
        assert untied["loss_err"] <= 1e-5 and untied["grad_rel_err"] <= FP32_TOL, untied
        assert tied["loss_err"] <= 1e-5 and tied["grad_rel_err"] <= BF16_REL, tied


def test_forward_only_gives_the_loss_and_no_gradients(world4):
    for r in world4:
        assert r["eval"]["loss_err"] <= FP32_TOL and r["eval"]["no_grads"], r["eval"]


def test_inflight_activations_1f1b_at_most_p_minus_s_gpipe_all(world4):
    for r in world4:  # stage s of a P=4 pipeline with m=6 micro-batches
        peak = r["peak"]
        assert peak["1f1b"] == 4 - peak["stage"], peak
        assert peak["gpipe"] == 6, peak


def test_tied_embedding_replicas_bitwise_identical_after_3_steps(world4):
    """PP=2 x DP=2, 3 train_step calls on mock data (AdamW, lr 1e-2): the first stage's input
    embedding and the last stage's output layer (and both DP replicas) hash the same, the
    weights moved, and the run matches a one-process run.

    How it is compared with the one-process run, and why:
    - the first step's gradients, before any optimizer step, within FP32_TOL: the sharp check.
      AdamW's update lr * m / (sqrt(v) + eps) depends on the gradient's scale only through
      eps, so a gradient scaled wrongly (say halved) shows in the weights only where the
      gradient is near eps;
    - the 3 losses within rel 1e-6 (~10 fp32 ulps at 5.3): steps 2 and 3 see the updated weights;
    - the weights after the 3 steps: at most 1 element in 1000 further than 1e-5 (1e-3 of one
      step's update lr), and none further than 2 * lr * 3. Elementwise, AdamW amplifies fp32
      rounding where the gradient is near zero (g / sqrt(v) of a rounding-sized g can take any
      value in [-1, 1], up to 2 * lr apart per step): observed, 42 of ~32k elements differ by
      more than 1e-6 and the worst by 1.4e-5, so a maximum-norm bound would either fail on
      rounding or have to allow 2 * lr * steps; a wrong update (replica not synchronised,
      stale gradient) moves most elements by ~lr.
    """
    lr, steps = 1e-2, 3
    train = [r["train"] for r in world4]
    hashes = {(t["stage"], t["dp"]): t["replica"] for t in train}
    assert set(hashes) == {(0, 0), (0, 1), (1, 0), (1, 1)} and None not in hashes.values()
    assert len(set(hashes.values())) == 1, hashes
    for t in train:
        assert t["moved"] > 1e-3, "the optimizer did not change the weights: the test would prove nothing"
        assert t["grad_err"] <= FP32_TOL, t["grad_err"]
        assert t["losses"] == pytest.approx(t["ref_losses"], rel=1e-6, abs=0), (t["losses"], t["ref_losses"])
        errs = t["param_errs"]
        assert sum(e > 1e-5 for e in errs) <= len(errs) / 1000, sorted(errs)[-20:]
        assert max(errs) <= 2 * lr * steps, max(errs)


def test_loss_is_the_token_mean_of_the_global_batch(world4):
    """Micro-batches keep 5%..100% of their tokens (and differ in shape) within and between
    DP ranks: PP=2 x DP=2 (1F1B) and DP=4 reproduce sum(loss x mask) / sum(mask) over the
    whole global batch, computed directly on one process (not with the schedules)."""
    assert check_equivalence([{"equiv": r["tokens"]} for r in world4], "") == 2


def test_backward_scale_hook_gets_loss_scale_over_microbatches():
    """MoE router losses are averaged over micro-batches through this hook (Megatron-LM's
    convention); evaluation does not touch it."""
    cfg = make_cfg(num_layers=2)
    model, single = build_model(cfg, ParallelState.single()), ParallelState.single()
    mbs = make_microbatches(3, cfg.model.vocab_size)
    calls = []
    forward_backward_no_pipelining(model, mbs, single, loss_scale=8.0, on_backward_scale=calls.append)
    assert calls == [8.0 / 3]
    forward_backward_no_pipelining(model, mbs, single, forward_only=True, on_backward_scale=calls.append)
    assert calls == [8.0 / 3]


def test_get_forward_backward_func():
    """Each schedule kind the config can choose runs its function; the pipelined ones are the one
    driver over their order, receives posted ahead as the plan says."""
    assert get_forward_backward_func(SchedulePlan(NO_PIPELINING, 1, 1)) is forward_backward_no_pipelining
    for stages in (1, 2):
        assert get_forward_backward_func(SchedulePlan(COMBINED, stages, 1)) is forward_backward_combined_1f1b
    for kind, chunks, order in ((GPIPE, 1, "gpipe"), (ONE_F_ONE_B, 1, "1f1b"), (INTERLEAVED, 2, "1f1b")):
        for ahead in (False, True):
            fn = get_forward_backward_func(SchedulePlan(kind, 2, chunks, posts_receives_ahead=ahead))
            assert fn.keywords == {"schedule": order, "chunks": chunks, "overlap_p2p_comm": ahead}


def test_a_chunked_model_under_a_plain_schedule_fails():
    """A model built with interleaving (2 chunks per rank) run by the plain 1F1B driver would
    skip half its layers: the driver refuses it."""
    cfg = make_cfg(pp=2, num_layers_per_virtual_pipeline_stage=1)
    pp2 = ParallelState(layout=Layout(pp=2), rank=0)
    model = build_model(cfg, pp2, meta=True)
    with pytest.raises(ValueError, match="holds 2 model chunks per pipeline rank, the schedule runs 1"):
        get_forward_backward_func(SchedulePlan(ONE_F_ONE_B, 2, 1))(
            model, make_microbatches(2, cfg.model.vocab_size), pp2
        )
