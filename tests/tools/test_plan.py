"""p2r-plan end to end (in-process): the 10T example side by side, JSON, meta verification of
a 512-rank layout, a plan that does not fit, and bad flags."""

from __future__ import annotations

import json

import pytest

from tools.plan import main, parse_count
from tests.planning.plan_argv import SHAPE, TEN_T


def test_10t_plan_table_and_verification(capsys):
    # exit 1: the real phase's offloaded state does not fit the V100 node's host memory
    assert (
        main(TEN_T + ["--token-budget", "50B", "--verify-rank", "0", "--verify-rank", "511", "--verify-all-ranks"]) == 1
    )
    out = capsys.readouterr().out
    assert "== pseudo phase: 512 x V100-32GB" in out and "== real phase: 512 x V100-32GB" in out
    assert "10,056,361,936,896 parameters" in out and "offloaded to host: 47 layers" in out
    assert "5e+10 tokens:" in out and out.count("FITS: ") == 1 and out.count("DOES NOT FIT: host overflows") == 1
    assert out.count(": OK") == 6 and "MISMATCH" not in out
    assert "logical parameters 10,056,361,936,896 (model 10,056,361,936,896)" in out


def test_json_has_both_phases_and_every_category(capsys):
    assert main(TEN_T + ["--json", "--verify-rank", "3"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and set(data["plans"]) == {"pseudo", "real"}
    assert data["plans"]["pseudo"]["fits"] and not data["plans"]["real"]["fits"]
    real = data["plans"]["real"]["stages"][0]
    assert set(real["device"]) == {
        "reserve",
        "params",
        "grads",
        "optimizer",
        "fetch_window",
        "activations",
        "transient",
    }
    # fp16 weights (2 B) on host with their fp32 mains and moments (12 B)
    assert real["host"]["optimizer"] == 6 * real["host"]["params"] > 0
    assert set(real["comm_bytes"]) == {"tp", "cp", "dp", "ep", "expert_dp", "pp", "embedding", "sharing", "tp_partial"}
    check = data["verification"]["real"][0]
    assert check["rank"] == 3 and check["problems"] == [] and check["parameters"] == real["parameters"]


def test_without_phase_files_plans_the_other_phase_too(capsys):
    argv = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--vocab-size",
        "256",
        "--p2r-phase",
        "pseudo",
        "--share-pattern",
        "all",
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "4",
        "--gpu",
        "H100-80GB",
    ]
    assert main(argv + ["--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert list(plans) == ["pseudo", "real"]
    assert plans["pseudo"]["logical_parameters"] < plans["real"]["logical_parameters"]
    # the pseudo slot lives on both stages: its gradient goes over the "sharing" group
    assert (
        plans["pseudo"]["stages"][0]["comm_bytes"]["sharing"] > 0 == plans["real"]["stages"][0]["comm_bytes"]["sharing"]
    )


def test_does_not_fit_exit_status_and_message(capsys):
    assert main(TEN_T + ["--gpu-memory", "12GiB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert "rank 0 (stage 0, ranks 0-511) needs 14.99 GiB of 12.00 GiB" in out and "overflows at 'transient'" in out
    assert "DOES NOT FIT: GPU overflows by 2.99 GiB: rank 0 (stage 0) needs 14.99 of 12.00 GiB; host fits" in out


def test_bad_input(capsys):
    assert main(TEN_T + ["--tensor-model-parallel-size", "3"]) == 2
    assert "--num-attention-heads (16) must be divisible by --tensor-model-parallel-size (3)" in capsys.readouterr().err
    assert main(TEN_T + ["--verify-rank", "512"]) == 2
    assert "outside the world of 512 ranks" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,value",
    [
        ("50e9", 5e10),
        ("5E10", 5e10),
        ("1.5e+10", 1.5e10),
        ("2.5E-3T", 2.5e9),
        ("50B", 5e10),
        ("1.2T", 1.2e12),
        (".5k", 500.0),
    ],
)
def test_token_budget_formats(text, value):
    assert parse_count(text) == pytest.approx(value)


def test_p2r_cost_ratio_and_break_even(capsys):
    """r is the real plan's step time over the pseudo plan's; the break-even is s(1 - 1/r) with
    s = 10% of the run (--token-budget / tokens per step) unless --p2r-switch-iters says."""
    assert main(TEN_T + ["--token-budget", "50B", "--json"]) == 1  # the real phase overflows the host
    data = json.loads(capsys.readouterr().out)
    real, pseudo, p2r = data["plans"]["real"], data["plans"]["pseudo"], data["p2r"]
    assert p2r["r"] == real["step_time_s"] / pseudo["step_time_s"] > 1  # the 10T real phase offloads
    assert (
        p2r["total_iters"] == round(50e9 / real["tokens_per_step"]) and p2r["switch_iters"] == p2r["total_iters"] // 10
    )
    assert p2r["break_even_extra_steps"] == p2r["switch_iters"] * (1 - 1 / p2r["r"])
    assert main(TEN_T + ["--token-budget", "50B", "--p2r-switch-iters", "1000"]) == 1
    out = capsys.readouterr().out
    assert f"r = {p2r['r']:.3f}" in out
    assert (
        f"delinking after 1,000 of {p2r['total_iters']:,} steps (--p2r-switch-iters): break-even s(1 - 1/r) = "
        f"{1000 * (1 - 1 / p2r['r']):,.0f} steps" in out
    )
    assert main(TEN_T + ["--p2r-switch-iters", "0"]) == 2
    assert "--p2r-switch-iters must be >= 1" in capsys.readouterr().err
    assert main(TEN_T + ["--train-iters", "1000", "--p2r-switch-iters", "1001"]) == 2
    assert "--p2r-switch-iters 1001 is beyond the run's 1000 steps" in capsys.readouterr().err


def test_measured_gap_says_which_method_pays(capsys):
    """--p2r-gap (steps, % of the run, never) and --growth-flops-ratio against the planned r."""
    assert main(TEN_T + ["--token-budget", "50B", "--p2r-gap", "1%", "--growth-flops-ratio", "0.75", "--json"]) == 1
    p2r = json.loads(capsys.readouterr().out)["p2r"]
    measured = p2r["measured"]
    assert measured["p2r"]["extra_steps"] == pytest.approx(0.01 * p2r["total_iters"])
    s, n, r = p2r["switch_iters"], p2r["total_iters"], p2r["r"]
    assert measured["p2r"]["time_ratio"] == pytest.approx((s / r + n + 0.01 * n - s) / n)
    assert measured["p2r"]["pays"] and measured["best"] == "growth"
    assert main(TEN_T + ["--token-budget", "50B", "--p2r-gap", "never"]) == 1
    out = capsys.readouterr().out
    assert "measured gap: never" in out and out.rstrip().endswith("verdict: neither pays on this cluster")
    with pytest.raises(SystemExit) as exit_:
        main(TEN_T + ["--p2r-gap", "soon"])
    assert exit_.value.code == 2 and "--p2r-gap: expected extra steps (120)" in capsys.readouterr().err
    assert main(TEN_T + ["--growth-flops-ratio", "0"]) == 2
    assert "--growth-flops-ratio must be > 0" in capsys.readouterr().err


def test_context_parallelism_is_planned(capsys):
    """CP in the layout line, the ring's traffic and its exposed part in the step line."""
    assert main(SHAPE + ["--world-size", "2", "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP 1 CP 2 PP 1 DP 1" in out and "cp 0" in out and " exposed)" in out
