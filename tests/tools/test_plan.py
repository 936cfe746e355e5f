"""p2r-plan end to end (in-process): the 10T example side by side, JSON, meta verification of
a 512-rank layout, a plan that does not fit, and bad flags."""
from __future__ import annotations

import json

from tools.plan import main

TEN_T = ["--config", "examples/m6_10t/model.yaml", "--pseudo-config", "examples/m6_10t/pseudo.yaml",
         "--real-config", "examples/m6_10t/real.yaml", "--world-size", "512", "--gpu", "V100-32GB"]


def test_10t_plan_table_and_verification(capsys):
    assert main(TEN_T + ["--token-budget", "50B", "--verify-rank", "0", "--verify-rank", "511",
                         "--verify-all-ranks"]) == 0
    out = capsys.readouterr().out
    assert "== pseudo phase: 512 x V100-32GB" in out and "== real phase: 512 x V100-32GB" in out
    assert "10,056,361,445,376 parameters" in out and "offloaded to host: 47 layers" in out
    assert "5e+10 tokens:" in out and out.count("FITS") == 2
    assert out.count(": OK") == 6 and "MISMATCH" not in out
    assert "logical parameters 10,056,361,445,376 (model 10,056,361,445,376)" in out


def test_json_has_both_phases_and_every_category(capsys):
    assert main(TEN_T + ["--json", "--verify-rank", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and set(data["plans"]) == {"pseudo", "real"}
    real = data["plans"]["real"]["stages"][0]
    assert set(real["device"]) == {"reserve", "params", "grads", "optimizer", "fetch_window", "compute_weights",
                                   "activations", "transient"}
    assert real["host"]["optimizer"] == 2 * real["host"]["params"] > 0
    assert set(real["comm_bytes"]) == {"tp", "dp", "ep", "expert_dp", "pp", "embedding", "sharing"}
    check = data["verification"]["real"][0]
    assert check["rank"] == 3 and check["problems"] == [] and check["parameters"] == real["parameters"]


def test_without_phase_files_plans_the_other_phase_too(capsys):
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "256", "--p2r-phase", "pseudo", "--share-pattern", "all",
            "--pipeline-model-parallel-size", "2", "--world-size", "4", "--gpu", "H100-80GB"]
    assert main(argv + ["--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert list(plans) == ["pseudo", "real"]
    assert plans["pseudo"]["logical_parameters"] < plans["real"]["logical_parameters"]
    # the pseudo slot lives on both stages: its gradient goes over the "sharing" group
    assert plans["pseudo"]["stages"][0]["comm_bytes"]["sharing"] > 0 == plans["real"]["stages"][0]["comm_bytes"]["sharing"]


def test_does_not_fit_exit_status_and_message(capsys):
    assert main(TEN_T + ["--gpu-memory", "12GiB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert "rank 0 (stage 0, ranks 0-511) needs 15.81 GiB of 12.00 GiB" in out and "overflows at 'transient'" in out
    # host memory is checked when given: 10T real needs ~2.3 TiB of host memory per node
    assert main(TEN_T + ["--host-memory", "128GiB"]) == 1
    assert "does not fit on host" in capsys.readouterr().out


def test_bad_input(capsys):
    assert main(TEN_T + ["--tensor-model-parallel-size", "3"]) == 2
    assert "--num-attention-heads (16) must be divisible by --tensor-model-parallel-size (3)" in capsys.readouterr().err
    assert main(TEN_T + ["--verify-rank", "512"]) == 2
    assert "outside the world of 512 ranks" in capsys.readouterr().err
