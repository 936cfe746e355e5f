"""Expert parallelism reproduces the one-process run: EP=2, EP=4, EP=2 x expert-DP=2,
TP=2 x EP=2, PP=2 x EP=2; dropless, capacity without drops, capacity with drops. The grouped/
cases run the experts through grouped_mm (--moe-grouped-gemm) under EP=2 and TP=2 x EP=2 against
the one-process run with the padded experts, at the same tolerances.

The ranks (``workers.py``) run each case and, in the same rank, the one-process reference on
all ranks' inputs; these tests assert on the errors they report.

Tolerances (fp32). Layer cases (init std 0.2, router x5: outputs and gradients of order 1-10):
1e-5 absolute (observed <= 1.5e-6; rows are summed in another order). Model cases: loss and
gradients within 1e-6 of the reference (observed <= 5e-7 loss, 6e-8 gradients). Capacity drops
are decided on each source rank from its own tokens, so even with drops EP must match the
reference exactly as above. Gradients are those training reduces: layer cases take the layer
from a model built as training builds it and compare the DDP-reduced ``main_grad``
(``tests/moe/common.layer_with_grad_buffers``), model cases as ``tests/pipeline/common``.

16-bit weights (--bf16) + recompute, against the one-process bf16 model with fp32 gradient sums:
loss within 1e-5 (observed 4.8e-7), gradients within BF16_REL of each tensor's largest
reference element (observed 5.1e-3; the largest errors are all in expert weights: after the
all-to-all the experts' bf16 matmuls see their rows in other groupings, so they round differently).
"""

from __future__ import annotations

import json
from typing import Optional

import pytest

LAYER_TOL = 1e-5
MODEL_TOL = 1e-6
BF16_REL = 2e-2


def check_layer(results, label: str) -> None:
    for rank, res in enumerate(results):
        r = res["layer"][label]
        assert r["out_err"] <= LAYER_TOL, f"{label} rank {rank}: output differs by {r['out_err']}"
        worst = max(r["grad_err"], key=r["grad_err"].get)
        assert r["grad_err"][worst] <= LAYER_TOL, (
            f"{label} rank {rank}: {worst} gradient differs by {r['grad_err'][worst]}"
        )


def check_model(
    results, label: str, section: str = "model", tol: float = MODEL_TOL, rel_tol: Optional[float] = None
) -> None:
    """Loss and gradients within ``tol``; with ``rel_tol``, gradients within it relative to each
    tensor's largest reference element instead."""
    held = set()
    for rank, res in enumerate(results):
        r = res[section][label]
        assert r["loss_err"] <= tol, f"{label} rank {rank}: loss differs by {r['loss_err']}"
        err, limit = (r["grad_err"], tol) if rel_tol is None else (r["grad_rel_err"], rel_tol)
        assert err <= limit, f"{label} rank {rank}: gradient differs by {err}"
        held.update(r["names"])
    ref_names = set(results[0][section][label]["ref_names"])
    assert ref_names == held, f"{label}: gradients not compared: {ref_names ^ held}"
    assert any(".mlp.experts." in n for n in held) and any(".mlp.router." in n for n in held)


LAYER_CASES = (
    "top2/dropless",
    "top1/capacity-no-drop",
    "top2/capacity-drops",
    "top2/capacity-drops/position",
    "top2/capacity-padded",
    "prototypes",
    "swiglu-bias",
)
GROUPED_LAYER_CASES = ("grouped/top2/dropless", "grouped/top2/capacity-drops", "grouped/swiglu-bias")


def test_ep2_layer_matches_single_process(moe_world2):
    for case in LAYER_CASES:
        check_layer(moe_world2, f"ep2/{case}")
    # every rank's experts did receive rows from the all-to-all
    assert all(res["layer"]["ep2/top2/dropless"]["received"] > 0 for res in moe_world2)


def test_ep4_layer_matches_single_process(moe_world4):
    for case in ("top2/dropless", "top1/capacity-no-drop", "top2/capacity-drops"):
        check_layer(moe_world4, f"ep4/{case}")


def test_ep2_model_step_matches_single_process(moe_world2):
    for case in ("dropless", "capacity-no-drop", "capacity-drops", "prototypes-recompute"):
        check_model(moe_world2, f"ep2/{case}")
    check_model(moe_world2, "ep2/bf16-recompute", section="bf16", tol=1e-5, rel_tol=BF16_REL)


def test_ep4_model_step_matches_single_process(moe_world4):
    check_model(moe_world4, "ep4/dropless")
    check_model(moe_world4, "ep4/capacity-no-drop")


def test_tp2_ep2_matches_single_process(moe_world4):
    for case in LAYER_CASES:
        check_layer(moe_world4, f"tp2ep2/{case}")
    check_model(moe_world4, "tp2ep2/dropless-swiglu")
    check_model(moe_world4, "tp2ep2/capacity-drops")


def test_pp2_ep2_matches_single_process(moe_world4):
    check_model(moe_world4, "pp2ep2/dropless/1f1b")
    check_model(moe_world4, "pp2ep2/capacity-drops/1f1b")


def test_grouped_gemm_under_ep_and_tp_matches_padded_single_process(moe_world2, moe_world4):
    """grouped_mm experts against the padded experts on one process: layer cases under EP=2 and
    TP=2 x EP=2 (dropless, capacity drops, SwiGLU with biases), model steps (EP=2 capacity
    drops, TP=2 x EP=2 dropless SwiGLU, EP=2 bf16 + recompute); grouped_mm did run, and only there."""
    for results, prefix in ((moe_world2, "ep2"), (moe_world4, "tp2ep2")):
        for case in GROUPED_LAYER_CASES:
            check_layer(results, f"{prefix}/{case}")
        for rank, res in enumerate(results):
            for label, r in res["layer"].items():
                if label.startswith(prefix + "/"):
                    grouped = "/grouped/" in label
                    assert (r["grouped_mm_calls"] > 0) == grouped, f"{label} rank {rank}: {r['grouped_mm_calls']}"
            assert res["grouped_model_calls"] > 0, f"{prefix} rank {rank}: the model cases did not run grouped_mm"
    check_model(moe_world2, "ep2/grouped/capacity-drops")
    check_model(moe_world4, "tp2ep2/grouped/dropless-swiglu")
    check_model(moe_world2, "ep2/grouped/bf16-recompute", section="bf16", tol=1e-5, rel_tol=BF16_REL)


def test_rank_whose_experts_get_no_tokens(moe_world2, moe_world4):
    """A router bias sends every token to EP rank 0's experts: the other ranks run forward and
    backward on zero rows, join every collective, and end with exactly zero expert gradients."""
    for results, label in (
        (moe_world2, "ep2/zero-tokens"),
        (moe_world2, "ep2/grouped/zero-tokens"),
        (moe_world4, "ep4/zero-tokens"),
    ):
        check_layer(results, label)
        assert results[0]["layer"][label]["received"] > 0
        for rank, res in enumerate(results[1:], start=1):
            r = res["layer"][label]
            assert r["received"] == 0, f"{label} rank {rank} received {r['received']} rows"
            assert not r["expert_grad_nonzero"]


def test_expert_grads_reduced_over_expert_dp_divided_by_dp(moe_world2, moe_world4):
    """With EP=2 x expert-DP=2 (DP=4), expert gradients match the reference; averaging the same
    raw gradients over the whole dp group (mixes different experts), or dividing the expert-dp
    sum by expert-DP instead of DP, would be far off: the check discriminates."""
    check_layer(moe_world4, "ep2xedp2/top2/dropless")
    check_layer(moe_world4, "ep2xedp2/swiglu-bias")
    check_model(moe_world4, "ep2xedp2/dropless")
    for results, label in (
        (moe_world4, "ep2xedp2/top2/dropless"),
        (moe_world2, "ep2/top2/dropless"),
        (moe_world4, "ep4/top2/dropless"),
    ):
        for rank, res in enumerate(results):
            r = res["layer"][label]
            assert r["wrong_group_err"] > 100 * LAYER_TOL, f"{label} rank {rank}: dp-group average not detectable"
            assert r["wrong_divisor_err"] > 100 * LAYER_TOL, f"{label} rank {rank}: expert-dp divisor not detectable"


def test_bf16_rows_cross_the_all_to_all_in_bf16(moe_world2):
    """Dispatch and combine, forward and backward: four row all-to-alls, all bf16 (half the bytes)."""
    for res in moe_world2:
        assert res["bf16_rows"] == ["torch.bfloat16"] * 4, res["bf16_rows"]


def test_ep2_training_steps_match_single_process(moe_world2):
    """3 optimizer steps (capacity 1.0, so some tokens drop) stay on the one-process run: losses
    (rel 1e-5) and weights (abs 1e-4, as tests/training/test_training.py: Adam amplifies rounding of
    tiny gradient elements) — the optimizer sees correctly reduced expert gradients."""
    for res in moe_world2:
        r = res["train"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["param_err"] < 1e-4 < r["moved"]


def test_training_log_has_routing_figures(moe_world2, moe_log_file):
    with open(moe_log_file, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if '"lm_loss"' in line]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 < r["moe_dropped_fraction"] < 1.0  # capacity factor 0.5 must drop
        assert 0.0 <= r["moe_min_load"] <= 1.0 <= r["moe_max_load"]
