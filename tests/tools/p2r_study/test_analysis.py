"""The study's analysis on synthetic curves whose answers are known by hand."""

import pytest

from tools.p2r_study import analysis as an
from tools.p2r_study.heldout import clustered_se, mean_se, paired_se
from tools.p2r_study.report import verdicts
from megatron_p2r.planning.breakeven import break_even_extra_steps, cost_ratio

TPS = {"m": 100}
F = 1000.0  # FLOPs per token of the real model
TIMING = {
    "m/real": 1.0,
    "m/real@budget": 2.0,
    "m/small": 0.25,
    "m/small@budget": 0.25,
    "m/pseudo": 1.0,
    "m/pseudo@budget": 1.0,
}
REAL = {"kind": "m/real", "start": 0, "end": 400, "flops_per_token": F}


def _run(arm, seed, phases, points, spread=(-0.2, 0.0, 0.2)):
    """A run whose points carry an SE of 0.01 and whose final per-sample losses lie ``spread``
    around its last loss (equal spreads: paired differences with an SE of 0)."""
    return {
        "model": "m",
        "arm": arm,
        "seed": seed,
        "phases": phases,
        "points": [(*p, 0.01) for p in points],
        "final_losses": [points[-1][1] + d for d in spread] if points else [],
        "tokens_per_step": 100,
    }


def _grow(seed, points):
    return _run(
        "grow",
        seed,
        [{"kind": "m/small", "start": 0, "end": 100, "flops_per_token": F / 4}, dict(REAL, start=100)],
        points,
    )


def _p2r(seed, points, end=400):
    return _run(
        "p2r",
        seed,
        [{"kind": "m/pseudo", "start": 0, "end": 100, "flops_per_token": F}, dict(REAL, start=100, end=end)],
        points,
    )


SCRATCH = [(0, 10.0), (100, 6.0), (200, 5.0), (300, 4.5), (400, 4.0)]


def test_crossing_and_costs():
    assert an.crossing_step(SCRATCH, 4.0) == 400
    assert an.crossing_step(SCRATCH, 5.5) == pytest.approx(150)
    assert an.crossing_step(SCRATCH, 12) == 0 and an.crossing_step(SCRATCH, 3.9) is None
    # a conversion adds a second point at its step: the jump is vertical, no step passes
    assert an.crossing_step([(100, 7.0), (100, 5.0), (200, 4.0)], 6.0) == 100
    phases = _grow(1, [])["phases"]
    c = an.costs_to(300, phases, 100, TIMING)
    assert c == {
        "steps": 300,
        "flops": 100 * 100 * F / 4 + 200 * 100 * F,
        "wall": 100 * 0.25 + 200 * 1.0,
        "wall_budget": 100 * 0.25 + 200 * 2.0,
    }


def test_paired_ratios_break_even_and_verdict():
    """Scratch reaches its final 4.0 at step 400 (FLOPs 400*100*F, wall 400 s, 800 s under the
    budget). Grow (seed 1) reaches 4.0 at step 300: FLOPs (25 + 200)/400 = 0.5625, wall
    (25 + 200)/400, under the budget (25 + 400)/800. P2R (seed 1) reaches it at 450 of a
    longer curve: 50 extra steps, where 100 pseudo steps at r = 2 allow 100*(1 - 1/2) = 50."""
    runs = [
        _run("real from scratch", 1, [REAL], SCRATCH),
        _run("real from scratch", 2, [REAL], [(0, 10.0), (200, 5.0), (400, 4.2)]),
        _grow(1, [(100, 7.0), (100, 6.5), (200, 4.5), (300, 4.0), (400, 3.8)]),
        _grow(2, [(100, 7.0), (100, 6.5), (200, 4.6), (300, 4.2), (400, 4.0)]),
        _p2r(1, [(100, 6.5), (300, 4.3), (500, 3.9)], end=500),
        _p2r(2, [(100, 6.5), (300, 4.5), (400, 4.3)]),
    ]
    stats = an.paired(runs, TIMING, TPS, "real from scratch")
    g = stats[("m", "grow")]
    assert g["ratios"]["flops"] == pytest.approx([0.5625, 0.5625])
    assert g["ratios"]["wall"] == pytest.approx([225 / 400, 225 / 400])
    assert g["ratios"]["wall_budget"] == pytest.approx([425 / 800, 425 / 800])
    assert g["delta"] == pytest.approx([-0.2, -0.2]) and g["extra"] == pytest.approx([-100, -100])
    assert g["allowed"] == pytest.approx([100 * (1 - 0.25 / 2)] * 2)
    # a crossing at its last step (400) would cost (100/4 + 300)/400 of scratch's FLOPs
    assert g["last_step_flops"] == pytest.approx([0.8125, 0.8125])
    assert g["se"] == [0.01, 0.01] and g["delta_se"] == pytest.approx([0, 0])
    p = stats[("m", "p2r")]
    assert p["allowed"] == pytest.approx([50, 50])
    assert p["extra"][0] == pytest.approx(50) and p["extra"][1] is None
    assert p["ratios"]["wall_budget"][0] == pytest.approx((100 * 1 + 350 * 2) / 800)
    assert an.wins(g["ratios"]["flops"], 0.8) and not an.wins(p["ratios"]["flops"], 0.8)
    lines = verdicts(stats, {}, ["m"], {"m": ["real from scratch", "p2r", "grow"]})
    assert lines[0].startswith("- **m, training FLOPs: target met** by grow")
    lines = verdicts(stats, {}, ["m"], {"m": ["real from scratch", "p2r"]})
    assert lines[0] == (
        "- m, training FLOPs: target **not met**; the best arm, p2r, never reaches the target in 1 of "
        "2 seeds; where it does, it needs up to 1.12x of scratch's cost."
    )
    assert an.ratio_cell(p["ratios"]["steps"]) == "1.12 (1/2 seeds never reach it)"  # one seed: no ± 0.00
    stats = an.paired([r for r in runs if r["seed"] == 2], TIMING, TPS, "real from scratch")
    assert verdicts(stats, {}, ["m"], {"m": ["real from scratch", "p2r"]})[0] == (
        "- m, training FLOPs: target **not met**; no arm reaches real-from-scratch's final loss in any seed."
    )


def test_break_even_formula_and_bands():
    assert cost_ratio(3.0, 2.0) == 1.5
    assert break_even_extra_steps([(100, 2.0)]) == 50
    assert break_even_extra_steps([(20, 2.0), (40, 4.0)]) == 10 + 30
    assert break_even_extra_steps([(100, 0.5)]) == -100  # a slower early phase must save steps
    with pytest.raises(ValueError):
        cost_ratio(1.0, 0.0)
    steps, mean, std = an.band([([1, 2], [2.0, 4.0]), ([1, 2], [4.0, 4.0])], "a")
    assert steps == [1, 2] and mean == [3.0, 4.0] and std[1] == 0 and std[0] == pytest.approx(2**0.5)
    with pytest.raises(ValueError, match="evaluated at different steps"):
        an.band([([1], [2.0]), ([2], [2.0])], "a")


def test_standard_errors_by_hand():
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and se == pytest.approx((5 / 3) ** 0.5 / 2)  # sample std sqrt(5/3), n = 4
    assert mean_se([3.0]) == (3.0, 0.0)
    assert paired_se([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(1 / 3**0.5)  # differences 0, 1, 2
    assert paired_se([1.0, 5.0, 9.0], [0.5, 4.5, 8.5]) == 0.0  # a constant shift is measured exactly
    with pytest.raises(ValueError, match="differ in number"):
        paired_se([1.0], [1.0, 2.0])


def test_compute_matched_controls():
    """Growth's final loss against its control's, per seed, with the paired SE."""
    runs = [
        _grow(1, [(100, 7.0), (400, 3.8)]),
        _run("ctl", 1, [REAL], [(300, 4.0)], spread=(0.0, 0.0, 0.3)),
        _grow(2, [(100, 7.0), (400, 4.0)]),
        _run("ctl", 2, [REAL], [(300, 3.9)]),
    ]
    out = an.matched(runs, lambda arm: "ctl" if arm == "grow" else None)
    assert list(out) == [("m", "grow")]
    e = out[("m", "grow")]
    assert e["seeds"] == [1, 2] and e["delta"] == pytest.approx([-0.2, 0.1])
    assert e["delta_se"] == pytest.approx([paired_se([-0.2, 0.0, 0.2], [0.0, 0.0, 0.3]), 0.0])


def test_document_and_seed_standard_errors_by_hand():
    """Issue 38: the held-out SE holds the models fixed; samples of one document are grouped
    (CR1: sqrt(G/(G-1) * sum of squared cluster sums) / n), and seeds give their own SE."""
    # differences 1, 2, 3, 4 (mean 2.5) in documents 0, 0, 1, 1: cluster sums -2, 2; sqrt(2 * 8) / 4
    assert clustered_se([1.0, 2.0, 3.0, 4.0], [0.0] * 4, [0, 0, 1, 1]) == pytest.approx(1.0)
    # one sample per document: CR1 is the plain paired SE
    assert clustered_se([1.0, 2.0, 3.0], [0.0] * 3, [5, 6, 7]) == pytest.approx(paired_se([1.0, 2.0, 3.0], [0.0] * 3))
    assert clustered_se([1.0, 2.0], [0.0, 0.0], [3, 3]) is None  # one document: no estimate
    assert an.seed_se([0.1, 0.3]) == pytest.approx(0.1) and an.seed_se([0.1]) is None
    assert an.fmt([0.8125, 0.8125]) == "0.812" and an.fmt([0.1, 0.3]) == "0.200 ± 0.141"


def test_one_verdict_line_per_claim_with_its_seed_count():
    """Issue 38: the 0.8 bar, each arm's gap to scratch and growth's gap to its control, each with
    its figure (mean ± seed SE) and in how many seeds it holds."""
    runs = [
        _run("real from scratch", 1, [REAL], SCRATCH),
        _run("real from scratch", 2, [REAL], [(0, 10.0), (200, 5.0), (400, 4.2)]),
        _grow(1, [(100, 7.0), (100, 6.5), (200, 4.5), (300, 4.0), (400, 3.8)]),
        _grow(2, [(100, 7.0), (100, 6.5), (200, 4.6), (300, 4.2), (400, 4.0)]),
        _run("ctl", 1, [REAL], [(300, 3.9)]),
        _run("ctl", 2, [REAL], [(300, 4.3)]),
    ]
    stats = an.paired(runs, TIMING, TPS, "real from scratch", documents=[0, 1, 1])
    controls = an.matched(runs, lambda arm: "ctl" if arm == "grow" else None, documents=[0, 1, 1])
    lines = verdicts(stats, controls, ["m"], {"m": ["real from scratch", "grow"]})
    assert lines[0].startswith("- **m, training FLOPs: target met** by grow")
    assert lines[-2] == (
        "- m, **grow** against real from scratch: final held-out loss -0.200 (equal in every seed); "
        "lower in 2 of 2 seeds, by more than 2 document SEs in 2 of 2."
    )
    # growth against its control: -0.1 and -0.3, seed SE 0.1
    assert lines[-1] == (
        "- m, **grow** against its compute-matched control: final held-out loss -0.200 ± 0.100 (seed "
        "SE); lower in 2 of 2 seeds, by more than 2 document SEs in 2 of 2."
    )


def test_difference_curve_is_paired_against_scratchs_curve():
    grow = _grow(1, [(100, 7.0), (100, 6.5), (250, 4.5)])
    steps, diff = an.difference_curve(grow, _run("real from scratch", 1, [REAL], SCRATCH))
    assert steps == [100, 100, 250] and diff == pytest.approx([1.0, 0.5, -0.25])  # scratch at 250: 4.75


def test_the_reproducing_command_carries_no_path_of_this_machine():
    from tools.p2r_study.report import _reproducing

    argv = [
        "--work",
        "/a/w",
        "--data-path",
        "/x/y.jsonl",
        "--out=/o",
        "--jobs",
        "2",
        "--tokenizer-model=/m/t.model",
        "--iters",
        "8",
        "--name",
        "n",
        "--valid-data-path",
        "v/held.jsonl",
    ]
    assert _reproducing(argv) == [
        "--data-path",
        "y.jsonl",
        "--tokenizer-model=t.model",
        "--iters",
        "8",
        "--valid-data-path",
        "held.jsonl",
    ]
