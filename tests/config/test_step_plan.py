"""The step plan's decision of how the host placement steps, and that the runtime and the
planner read it (the refusals: test_step_refusals.py)."""

from __future__ import annotations

import pytest

from megatron_p2r.config import build_step_plan
from tests.helpers import tiny_config

HOST = dict(cpu_offload_layers="1", bf16=True)


@pytest.mark.parametrize(
    "flags,keys,how",
    [
        (dict(), [0, 1], None),  # nothing offloaded
        (dict(cpu_offload_layers="1", cpu_offload_what="optimizer"), [0, 1], None),  # staged only
        (HOST, [0, 1], "serial"),
        (dict(HOST, overlap_cpu_optimizer_d2h_h2d=True), [0, 1], "overlapped"),  # --clip-grad 1 gates it
        (dict(HOST, overlap_cpu_optimizer_d2h_h2d=True, clip_grad=0.0), [0, 1], "early"),
        (dict(HOST, overlap_cpu_optimizer_d2h_h2d=True, clip_grad=0.0), [0, 0], "overlapped"),  # a pseudo slot
        (
            dict(cpu_offload_layers="1", fp16=True, overlap_cpu_optimizer_d2h_h2d=True, clip_grad=0.0),
            [0, 1],
            "overlapped",
        ),  # loss scaling gates it
        (
            dict(HOST, overlap_cpu_optimizer_d2h_h2d=True, cpu_offload_delayed_param_update=True, clip_grad=0.0),
            [0, 1],
            "delayed",
        ),
    ],
)
def test_how_the_host_placement_steps(flags, keys, how):
    plan = build_step_plan(tiny_config(**{"clip_grad": 1.0, **flags}))
    assert plan.host_step(keys) == how
    assert plan.overlapped == (how in ("overlapped", "early", "delayed"))
    assert plan.staged == (flags.get("cpu_offload_what") == "optimizer")


def test_state_on_nvme_and_threads():
    plan = build_step_plan(
        tiny_config(
            **HOST,
            overlap_cpu_optimizer_d2h_h2d=True,
            host_optimizer_threads=3,
            cpu_offload_optimizer_nvme_path="/nvme",
            cpu_offload_delayed_param_update_warmup_steps=5,
        )
    )
    assert (plan.nvme_path, plan.threads, plan.delay_warmup) == ("/nvme", 3, 5)
    assert build_step_plan(tiny_config(**HOST)).nvme_path is None
