"""The planner's measured verdict: Pseudo-to-Real's time ratio from r and a measured gap, and
which of P2R and depth growth pays, on cases computed by hand."""

import pytest

from megatron_p2r.planning.breakeven import Gap, measured_verdict, p2r_break_even, p2r_time_ratio, parse_gap
from megatron_p2r.planning.breakeven import format_p2r

# r = 2, delink after s = 100 of N = 1000 steps: break-even s(1 - 1/r) = 50 extra steps
SUMMARY = p2r_break_even(real_step_s=2.0, pseudo_step_s=1.0, switch_iters=100, total_iters=1000)


def test_parse_gap():
    assert parse_gap("never") == parse_gap(" NEVER ") == Gap(None)
    assert parse_gap("120") == Gap(120.0) and parse_gap("-3") == Gap(-3.0)
    assert parse_gap("5%") == Gap(0.05, fraction=True) and Gap(0.05, True).steps(1000) == pytest.approx(50)
    for bad in ("abc", "inf", "nan", "5%%", ""):
        with pytest.raises(ValueError, match="gap|expected"):
            parse_gap(bad)


def test_p2r_time_ratio_by_hand():
    assert SUMMARY["break_even_extra_steps"] == 50
    # (s/r + N + D - s) / N
    assert p2r_time_ratio(2.0, 100, 1000, 50) == pytest.approx(1.0)  # exactly the break-even: a tie
    assert p2r_time_ratio(2.0, 100, 1000, 20) == pytest.approx(0.97)
    assert p2r_time_ratio(2.0, 100, 1000, -100) == pytest.approx(0.85)  # fewer steps than scratch
    assert p2r_time_ratio(2.0, 100, 1000, None) is None


def test_measured_verdict_by_hand():
    tie = measured_verdict(SUMMARY, Gap(50))
    assert tie["p2r"] == {"extra_steps": 50, "time_ratio": pytest.approx(1.0), "pays": False} and tie["best"] is None
    assert measured_verdict(SUMMARY, Gap(0.10, True))["p2r"]["time_ratio"] == pytest.approx(1.05)  # 100 extra steps
    never = measured_verdict(SUMMARY, Gap(None), growth_flops_ratio=0.75)
    assert never["p2r"]["pays"] is False and never["growth"]["pays"] and never["best"] == "growth"
    both = measured_verdict(SUMMARY, Gap(20), growth_flops_ratio=0.75)
    assert both["p2r"]["pays"] and both["best"] == "growth"  # 0.75 < 0.97
    assert measured_verdict(SUMMARY, Gap(-100), growth_flops_ratio=0.9)["best"] == "p2r"  # 0.85 < 0.9
    assert measured_verdict(SUMMARY, growth_flops_ratio=1.1) == {
        "growth": {"time_ratio": 1.1, "pays": False},
        "best": None,
    }


def test_report_lines():
    text = format_p2r(dict(SUMMARY, measured=measured_verdict(SUMMARY, Gap(20), growth_flops_ratio=0.75)))
    assert (
        "measured gap: 20 extra steps (break-even 50): P2R takes 0.970x real-from-scratch's time to its loss, "
        "so it pays on this cluster" in text
    )
    assert "depth growth: 0.750x real-from-scratch's FLOPs to its loss" in text
    assert text.endswith("verdict: depth growth pays (the lower time ratio of the two)")
    text = format_p2r(dict(SUMMARY, measured=measured_verdict(SUMMARY, Gap(None))))
    assert "measured gap: never" in text and text.endswith("verdict: neither pays on this cluster")
    assert "measured" not in format_p2r(SUMMARY)
