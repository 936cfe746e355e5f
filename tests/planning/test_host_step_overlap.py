"""The planner's model of the overlapped host step (--overlap-cpu-optimizer-d2h-h2d): what of
the host AdamW the next forward (and, started in backward, the rest of backward) hides, by hand
on small cases, and in the 10T real phase."""

from __future__ import annotations

import json

import pytest

from megatron_p2r.planning.estimate import overlapped_optimizer_time
from tools.plan import main
from tests.planning.plan_argv import TEN_T as TEN_T_BASE

TEN_T = TEN_T_BASE + ["--token-budget", "50B", "--json"]


@pytest.mark.parametrize(
    "device,host,keys,offloaded,forward,want",
    [
        # last 2 of 4 layers on host, 1 s each; forward 0.5 s a layer reaches layer 2 at 1.0, layer 3 at 2.0:
        # layer 2 waits for its step (1.0, free), layer 3 until 2.0 (it would be there at 1.5): 0.5 s late
        (0.0, 2.0, [0, 1, 2, 3], [2, 3], 0.5, 0.5),
        # the first layer on host waits for its whole step: nothing before it to hide under
        (0.0, 2.0, [0, 1, 2, 3], [0, 1], 0.5, 1.5),
        # a host step shorter than the resident step costs nothing more
        (3.0, 2.0, [0, 1, 2, 3], [2, 3], 0.5, 3.0),
        # the resident step runs first: layer 0's step is done when the forward starts, layer 1 waits until 2.0
        (1.0, 2.0, [0, 1, 2, 3], [0, 1], 0.1, 1.9),
        # a pseudo slot serving layers 0 and 2 is stepped once, before its first use
        (0.0, 2.0, [0, 1, 0, 1], [0, 1], 0.5, 1.5),
    ],
)
def test_overlapped_optimizer_time_by_hand(device, host, keys, offloaded, forward, want):
    assert overlapped_optimizer_time(device, host, keys, offloaded, forward) == pytest.approx(want)


@pytest.mark.parametrize(
    "device,host,keys,offloaded,forward,want",
    [
        # last 2 of 4 on host, 1 s each, a layer's forward 0.5 s, backward 1.0 (1.5 recomputed): backward
        # (5 s) produces layer 3's gradients 3.5 s before its end, layer 2's 2.0 s before: both stepped
        # by -1.0, before the resident step ends: nothing left
        (0.0, 2.0, [0, 1, 2, 3], [2, 3], 0.5, 0.0),
        # first 2 on host: layer 1 final at -1.5 (stepped by -0.5), layer 0 at the end of backward (by
        # 1.0): the forward waits 1.0 at layer 0, against 1.5 after the norm
        (0.0, 2.0, [0, 1, 2, 3], [0, 1], 0.5, 1.0),
        # the host is the bottleneck: 2 s a layer for layers 1-3, final at -4.0, -2.5, -1.0: they end at
        # -2.0, 0.0, 2.0; the forward starts after the 0.5 s resident step and waits at layer 1 until 2.0
        (0.5, 6.0, [0, 1, 2, 3], [1, 2, 3], 0.5, 1.5),
        # a resident step longer than what is left of the host step
        (3.0, 2.0, [0, 1, 2, 3], [2, 3], 0.5, 3.0),
    ],
)
def test_early_start_by_hand(device, host, keys, offloaded, forward, want):
    assert overlapped_optimizer_time(device, host, keys, offloaded, forward, early=True) == pytest.approx(want)


def test_early_start_is_never_later_than_after_the_norm():
    for layers, offloaded, host, forward in [
        (8, [4, 5, 6, 7], 10.0, 0.3),
        (8, [0, 3, 7], 4.0, 0.01),
        (3, [0, 1, 2], 0.5, 1.0),
        (6, [1, 4], 100.0, 0.2),
    ]:
        keys = list(range(layers))
        early = overlapped_optimizer_time(0.2, host, keys, offloaded, forward, early=True)
        assert early <= overlapped_optimizer_time(0.2, host, keys, offloaded, forward) + 1e-12
        # hides at most the last micro-batch's backward on top of what the forward hides
        backward = forward * (2 * layers + len(offloaded))
        assert early >= max(0.2, host - backward - layers * forward) - 1e-12


def test_never_worse_than_serial_and_hides_at_most_one_forward():
    for host in (0.1, 1.0, 10.0):
        got = overlapped_optimizer_time(0.2, host, list(range(8)), [4, 5, 6, 7], 0.3)
        assert max(0.2, host - 8 * 0.3) - 1e-12 <= got <= max(0.2, host) + 1e-12


def _real(argv, capsys) -> dict:
    main(argv)
    return json.loads(capsys.readouterr().out)["plans"]["real"]


def test_10t_real_phase_hides_part_of_the_host_step(tmp_path, capsys):
    """The example turns the overlap on; without it the same plan's optimizer is the serial
    max(resident, host) step and everything else is the same. One host thread per rank keeps the
    host step thread-bound, so both variants step equally fast (DRAM-bound, the overlapped one
    shares the DRAM with the next forward's fetches: tests/planning/test_host_step.py)."""
    with open("examples/m6_10t/real.yaml", encoding="utf-8") as fh:
        serial_yaml = fh.read().replace("overlap-cpu-optimizer-d2h-h2d: true", "")
    (tmp_path / "real.yaml").write_text(serial_yaml)
    one_thread = TEN_T + ["--host-optimizer-threads", "1"]
    overlapped = _real(one_thread, capsys)
    serial = _real([str(tmp_path / "real.yaml") if a == "examples/m6_10t/real.yaml" else a for a in one_thread], capsys)
    t, s = overlapped["stages"][0]["time_s"], serial["stages"][0]["time_s"]
    assert "host_optimizer_hidden" not in s
    assert 0 < t["host_optimizer_hidden"] == pytest.approx(s["optimizer"] - t["optimizer"])
    # at most the first micro-batch's forward: compute and all-to-all, a forward's share of them
    assert t["host_optimizer_hidden"] < (t["compute_per_microbatch"] + t["ep_per_microbatch"]) / 2
    assert overlapped["step_time_s"] == pytest.approx(serial["step_time_s"] - t["host_optimizer_hidden"])
    assert {k: v for k, v in t.items() if k not in ("optimizer", "host_optimizer_hidden")} == {
        k: v for k, v in s.items() if k != "optimizer"
    }


def test_10t_real_phase_starts_early_only_without_fp16(tmp_path, capsys):
    """--clip-grad 0 lets the host step start in backward in bf16 (A100), not with the V100's fp16
    loss scaling (its skip decision needs every gradient): the plan is then the clipped one's."""

    def real(gpu, clip, precision):
        model = tmp_path / f"model_{clip}_{precision}.yaml"
        with open("examples/m6_10t/model.yaml", encoding="utf-8") as fh:
            model.write_text(
                fh.read().replace("fp16: true", f"{precision}: true").replace("clip-grad: 1.0", f"clip-grad: {clip}")
            )
        argv = [str(model) if a == "examples/m6_10t/model.yaml" else gpu if a == "V100-32GB" else a for a in TEN_T]
        return _real(argv, capsys)["stages"][0]["time_s"]

    assert real("V100-32GB", 0.0, "fp16") == real("V100-32GB", 1.0, "fp16")
    early, clipped = real("A100-80GB", 0.0, "bf16"), real("A100-80GB", 1.0, "bf16")
    assert early["host_optimizer_hidden"] > clipped["host_optimizer_hidden"] > 0
