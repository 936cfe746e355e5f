"""The planner with the auxiliary-loss-free expert bias (--moe-router-enable-expert-bias,
moe/expert_bias.py): the routers' fp32 buffers each rank holds (its MoE modules', a pseudo slot's
once per stage, the MoE MTP depths' on the last stage) are the bytes a meta build of every rank
class allocates, and the per-step all-reduce of the counts is the table ``update_expert_biases``
hands ``dist.all_reduce``, on a tiny DeepSeek-V3-shaped model (tests/planning/test_deepseek_v3.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.moe import expert_bias
from megatron_p2r.planning import communication, estimate, hardware, memory
from megatron_p2r.planning.timing import link_time
from tests.planning.test_deepseek_v3 import PP2_EP2, tiny
from tools.plan import build_meta, verify_rank

WORLD = 4
# routers per stage: real, stage 0 (0, 1): layer 1; stage 1 (2, 3): layers 2, 3 and the MTP depth.
# pseudo (share_pattern all): stage 0 (0, 1), stage 1 (1, 1): the shared slot 1 once each, the depth
ROUTERS = {"real": [1, 3], "pseudo": [1, 2]}
TABLE_ROWS = {"real": 4, "pseudo": 2}  # every bias of the model once: layers 1-3 and the depth; slot 1 and the depth


def _cfg(phase: str, **overrides):
    return tiny(**PP2_EP2, p2r_phase=phase, share_pattern="all", bf16=True, **overrides)


@pytest.mark.parametrize("phase", ["real", "pseudo"])
def test_every_rank_allocates_the_buffers_the_planner_counts(phase):
    """bf16 weights, fp32 buffers: each rank's built buffer bytes equal the planner's, in the
    stage's device bytes (and the plan's total), two buffers of E fp32 per router."""
    cfg = _cfg(phase)
    plan = ParallelPlan.for_world(cfg, WORLD)
    full = estimate.make_plan(cfg, WORLD, hardware.GPU_PRESETS["H800-80GB"])
    for rank in range(WORLD):
        r = verify_rank(cfg, WORLD, rank)
        assert r["problems"] == [], r["problems"]
        stage = r["stage"]
        planned = memory.expert_bias_bytes(plan, stage)
        assert r["buffer_bytes"] == planned == ROUTERS[phase][stage] * 2 * cfg.model.num_experts * 4
        assert full.stages[stage].device["buffers"] == planned


def test_no_expert_bias_no_buffers_and_no_all_reduce():
    cfg = _cfg("real", moe_router_enable_expert_bias=False)
    plan = estimate.make_plan(cfg, WORLD, hardware.GPU_PRESETS["H800-80GB"])
    assert all("buffers" not in s.device and "expert_bias" not in s.comm_bytes for s in plan.stages)
    assert verify_rank(cfg, WORLD, 3)["buffer_bytes"] == 0


def test_the_flag_without_experts_biases_nothing():
    """--moe-router-enable-expert-bias on a dense model (Megatron-LM ignores it there): no buffers,
    no all-reduce, and a training step that updates nothing (it once crashed both)."""
    from megatron_p2r.parallel.state import ParallelState
    from tests.helpers import run_steps, tiny_config

    cfg = tiny_config(moe_router_enable_expert_bias=True)
    plan = estimate.make_plan(cfg, 1, hardware.GPU_PRESETS["H800-80GB"])
    assert all("buffers" not in s.device and "expert_bias" not in s.comm_bytes for s in plan.stages)
    losses, _ = run_steps(cfg, ParallelState.single(), 1)
    assert len(losses) == 1


@pytest.mark.parametrize("phase", ["real", "pseudo"])
def test_the_all_reduce_is_what_update_expert_biases_sends(phase, monkeypatch):
    """Every rank (also one whose stage has fewer routers) all-reduces the same [biases, E] fp32
    table, the names training/step.py passes; the planner's bytes are a ring's share of it over
    all ranks, and the step waits for it after the gradients' reduction."""
    cfg = _cfg(phase)
    plan = ParallelPlan.for_world(cfg, WORLD)
    m = cfg.model
    names = expert_bias.expert_bias_names(m, plan.layer_keys)  # as training/step.py calls it
    sent = []
    monkeypatch.setattr(expert_bias.dist, "all_reduce", lambda t, *a, **k: sent.append(t.numel() * t.element_size()))
    for rank in (0, WORLD - 1):
        model, _ = build_meta(cfg, plan, rank)
        try:
            expert_bias.update_expert_biases(model, names, m.num_experts, 1e-3, torch.device("meta"))
        finally:
            dist.destroy_process_group()
    table = communication.expert_bias_table_bytes(plan)
    assert sent == [table, table] and table == TABLE_ROWS[phase] * m.num_experts * 4
    gpu = hardware.GPU_PRESETS["H800-80GB"]
    for stage in range(2):
        traffic = communication.communication(cfg, plan, stage, gpu.gpus_per_node)["expert_bias"]
        assert traffic.size == WORLD and traffic.bytes == 2 * (WORLD - 1) / WORLD * table
    without = _cfg(phase, moe_router_enable_expert_bias=False)
    with_bias, no_bias = (estimate.make_plan(c, WORLD, gpu) for c in (cfg, without))
    wait = link_time(communication.expert_bias_traffic(plan, gpu.gpus_per_node), gpu)
    assert wait > 0
    for a, b in zip(with_bias.stages, no_bias.stages, strict=True):
        assert a.time_s["grad_sync"] == pytest.approx(b.time_s["grad_sync"] + wait, rel=1e-12)
