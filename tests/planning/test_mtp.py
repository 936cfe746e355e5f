"""The planner with multi-token prediction (model/mtp.py): the last stage's MTP depths in the
parameter counts (tensor-exact against meta builds), the FLOPs, and the activations a step
allocates (measured on CPU as tests/planning/test_planner.py measures them)."""

from __future__ import annotations

import math

import pytest

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.metrics import model_flops_per_token
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning import memory, timing
from megatron_p2r.parallel.state import Layout
from megatron_p2r.planning import activations
from tests.planning.test_planner import ACT_SHAPES, MOE, one_process_step, small
from tools.plan import verify_all_ranks, verify_rank

MTP = dict(mtp_num_layers=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
MTP_SHAPE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)


@pytest.mark.parametrize(
    "overrides,world",
    [
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True), 4),
        (dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, moe_layer_freq=[0, 1, 0, 1], **MOE), 4),
    ],
)
def test_planner_counts_the_depths_the_last_stage_builds(overrides, world):
    cfg = small(**MTP, **overrides)
    out = verify_all_ranks(cfg, world)
    assert out["problems"] == [] and out["logical_parameters"] == out["expected"]
    model_only = {k: v for k, v in overrides.items() if k in ("moe_layer_freq", "num_experts", "moe_ffn_hidden_size")}
    one = small(**MTP, **model_only)
    model = build_model(one, ParallelState.single(), meta=True)
    assert sum(p.numel() for p in model.parameters()) == memory.logical_parameter_count(ParallelPlan.for_world(one, 1))
    depths = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    without = small(**{**MTP, "mtp_num_layers": None}, **model_only)
    assert out["expected"] - depths == memory.logical_parameter_count(ParallelPlan.for_world(without, 1))
    plan = ParallelPlan.for_world(cfg, world)
    last = world - 1
    r = verify_rank(cfg, world, last)
    assert r["problems"] == [] and r["parameters"] == sum(s.numel for s in plan.tensors(plan.layout.coords(last).pp))


def test_stage_flops_add_up_to_model_flops():
    cfg = small(pipeline_model_parallel_size=2, moe_layer_freq=[0, 1, 0, 1], **MOE, **MTP)
    plan = ParallelPlan.for_world(cfg, 2)
    m, tokens = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    total = sum(timing.stage_flops_per_microbatch(cfg, plan, s) for s in range(2))
    logits_again = 3 * 2 * tokens * m.padded_vocab_size * m.hidden_size  # each loss's backward, 1 + 2 depths
    assert math.isclose(total, model_flops_per_token(m) * tokens + logits_again, rel_tol=1e-12)
    # the depths: 2 x (a MoE layer as the last one is, 2h -> h, the output layer), 3x their forward
    plain = small(
        pipeline_model_parallel_size=2, moe_layer_freq=[0, 1, 0, 1], **MOE, **{**MTP, "mtp_num_layers": None}
    ).model
    h, heads, d = m.hidden_size, m.num_attention_heads, m.head_dim
    layer = 2 * h * 2 * heads * d + 3 * h * 96 + h * 4  # attention; top-1 SwiGLU expert; router
    forward = 2 * (layer + 2 * h * h + h * m.padded_vocab_size) + 4 * m.seq_length * heads * d
    assert model_flops_per_token(m) - model_flops_per_token(plain) == 2 * 3 * forward


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mtp_num_layers=2, position_embedding_type="rope"),
        dict(mtp_num_layers=1, bf16=True, hidden_dropout=0.1, **MTP_SHAPE),
        dict(mtp_num_layers=2, bf16=True, moe_capacity_factor=0.5, **MOE, **MTP_SHAPE),
    ],
    ids=["fp32", "bf16-dropout", "bf16-moe"],
)
def test_activation_estimate_matches_measured_step(overrides):
    """Held bytes within 1%, peak within 10%, as the planner's own activation test."""
    cfg = small(**{**ACT_SHAPES, **overrides})
    held, peak = one_process_step(cfg)
    est = activations.activation_memory(cfg, ParallelPlan.build(cfg, Layout()), 0, device_type="cpu")
    without = activations.activation_memory(
        cfg.replace(mtp_num_layers=None),
        ParallelPlan.build(cfg.replace(mtp_num_layers=None), Layout()),
        0,
        device_type="cpu",
    )
    assert est["activations"] > without["activations"]
    assert abs(est["activations"] / held - 1) < 0.01, (est["activations"], held)
    assert abs((est["activations"] + est["transient"]) / peak - 1) < 0.10, (est, peak)
