"""The planner's model of --cpu-offload-delayed-param-update (optim/delayed_update.py): the host
step hidden under the next iteration's compute, the write of the new weights overlapped as the
undelayed host step is; the second gradient buffer on host; and the 10T real phase with it."""

from __future__ import annotations

import json

import pytest

from megatron_p2r.planning.estimate import delayed_update_time, overlapped_optimizer_time
from tools.plan import main

LEAN_10T = [
    "--config",
    "examples/m6_10t/model.yaml",
    "--pseudo-config",
    "examples/m6_10t/pseudo.yaml",
    "--real-config",
    "examples/m6_10t/real_lean.yaml",
    "--world-size",
    "512",
    "--gpu",
    "V100-32GB",
    "--token-budget",
    "50B",
    "--host-memory",
    "192GiB",
    "--use-precision-aware-optimizer",
    "--main-grads-dtype",
    "bf16",
    "--json",
]
DPU = ["--cpu-offload-delayed-param-update"]
KEYS, OFFLOADED = [0, 1, 2, 3], [0, 1]


@pytest.mark.parametrize(
    "host,write,window,exposed",
    [
        (5.0, 1.0, 10.0, 0.0),  # write and step fit the iteration: nothing of the step is exposed
        (9.5, 1.0, 10.0, 0.5),  # they exceed it by 0.5 s
        (20.0, 1.0, 10.0, 11.0),  # a host step twice the iteration: all of the excess
    ],
)
def test_delayed_update_time_by_hand(host, write, window, exposed):
    """On top of the exposed step, the write is overlapped as an undelayed host step of ``write`` s."""
    overlapped_write = overlapped_optimizer_time(0.1, write, KEYS, OFFLOADED, 0.5)
    got = delayed_update_time(0.1, host, write, window, KEYS, OFFLOADED, 0.5)
    assert got == pytest.approx(exposed + overlapped_write)


def _real(argv, capsys) -> dict:
    main(argv)
    return json.loads(capsys.readouterr().out)


def test_10t_real_lean_fits_192gib_with_r_below_1_3(capsys):
    """The README command on real_lean.yaml with bf16 main gradients: the delay adds one more
    bf16 gradient per offloaded parameter on host (2 B: 10 B/param in all) and hides most of the
    host step; on the DGX-1V's DRAM, shared with the offload copies, the step and the weight write
    outlast the iteration, and the excess is exposed."""
    undelayed, delayed = _real(LEAN_10T, capsys), _real(LEAN_10T + DPU, capsys)
    u, d = undelayed["plans"]["real"], delayed["plans"]["real"]
    host_u, host_d = u["stages"][0]["host"], d["stages"][0]["host"]
    assert host_d == {**host_u, "grads_delayed": host_u["grads"]}
    assert d["fits"] and d["tiers"]["host"]["fits"] and "warnings" not in d
    t = d["stages"][0]["time_s"]
    window = d["microbatches"] * (t["compute_per_microbatch"] + t["ep_per_microbatch"])
    assert t["host_optimizer_step"] > u["stages"][0]["time_s"]["host_optimizer_step"]  # beside all the copies
    excess = t["host_optimizer_delayed_write"] + t["host_optimizer_step"] - window
    assert 0 < excess < t["optimizer"] < u["stages"][0]["time_s"]["optimizer"]
    assert t["host_optimizer_hidden"] == pytest.approx(t["host_optimizer_step"] - t["optimizer"])
    assert delayed["p2r"]["r"] < undelayed["p2r"]["r"] < 1.3
    assert {k: v for k, v in d["step_breakdown_s"].items() if k != "optimizer"} == {
        k: v for k, v in u["step_breakdown_s"].items() if k != "optimizer"
    }


def test_the_plan_prints_the_delayed_update(capsys):
    main([a for a in LEAN_10T if a != "--json"] + DPU)
    out = capsys.readouterr().out
    assert (
        "delayed parameter update (stage 0): optimizer step 62.49 s and weight write 23.43 s under the next "
        "iteration, 21.84 s exposed; second gradient buffer 36.32 GiB per rank"
    ) in out
    assert "r = 1.265" in out


def test_the_flag_does_nothing_in_a_phase_without_offload(capsys):
    """Given on the command line it reaches the pseudo phase too, which offloads nothing."""
    assert _real(LEAN_10T, capsys)["plans"]["pseudo"] == _real(LEAN_10T + DPU, capsys)["plans"]["pseudo"]
