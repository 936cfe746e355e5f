"""The planner on a tiny model of DeepSeek-V3's shape (examples/deepseek_v3 at small sizes): latent
attention, dense first layers then MoE layers with a shared expert, sigmoid group-limited routing
with the expert bias, one MTP depth. Its tensors are what every rank builds (meta builds under
the fake process group, real and pseudo phase, PP2 x EP2), its activations what a one-process
step holds, its FLOPs count the shared experts, its active and MTP counts are the model's, the
step line breaks down the stage that sets the pipeline's time, and the last stage's all-to-all
includes its MoE MTP depth's.
"""

from __future__ import annotations

import math

import pytest

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.metrics import model_flops_per_token
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.planning import activations, communication, estimate, hardware, memory, timing
from tests.planning.test_planner import one_process_step, small
from tools.plan import format_plans, verify_all_ranks

# examples/deepseek_v3/model.yaml at small sizes: the same flags, 8 experts in 4 groups, top-4 of 2 groups
TINY_V3 = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    seq_length=32,
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=12,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    qk_layernorm=True,
    rotary_scaling_factor=40.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    num_experts=8,
    moe_layer_freq="([0]*1+[1]*3)",
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
    moe_router_topk=4,
    moe_router_pre_softmax=False,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_topk_scaling_factor=2.5,
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    moe_grouped_gemm=True,
    mtp_num_layers=1,
    mtp_loss_scaling_factor=0.3,
)
# untied as the example's phase files: the last stage holds a replica of the input embedding (docs/mtp.md)
PP2_EP2 = dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2)


def tiny(**overrides):
    return small(**{**TINY_V3, **overrides})


@pytest.mark.parametrize("phase", ["real", "pseudo"])
def test_every_rank_builds_what_the_planner_counts(phase):
    cfg = tiny(**PP2_EP2, p2r_phase=phase, share_pattern="all")
    out = verify_all_ranks(cfg, 4)
    assert out["problems"] == []
    assert out["logical_parameters"] == out["expected"]


def test_logical_active_and_mtp_counts_are_the_models():
    cfg = tiny()
    model = build_model(cfg, ParallelState.single(), meta=True)
    params = dict(model.named_parameters())
    plan = ParallelPlan.for_world(cfg, 1)
    assert memory.logical_parameter_count(plan) == sum(p.numel() for p in params.values())
    mtp = sum(p.numel() for n, p in params.items() if n.startswith("mtp."))
    assert mtp > 0 and memory.mtp_parameter_count(plan) == mtp
    # a token meets every tensor but the routed experts, and 4 of each MoE layer's 8 of those
    m = cfg.model
    routed = [p.numel() for n, p in params.items() if ".experts." in n and not n.startswith("mtp.")]
    main = sum(p.numel() for p in params.values()) - mtp
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    assert moe_layers == 3 and sum(routed) == moe_layers * 3 * m.hidden_size * m.expert_ffn_size * m.num_experts
    assert memory.active_parameter_count(plan) == main - sum(routed) + sum(routed) * 4 // 8
    assert memory.active_parameter_count(plan, with_mtp=True) == memory.active_parameter_count(plan) + mtp - (
        3 * m.hidden_size * m.expert_ffn_size * (8 - 4)
    )


@pytest.mark.parametrize("bf16", [False, True])
def test_activations_are_what_a_step_holds(bf16):
    cfg = tiny(bf16=bf16, micro_batch_size=2, hidden_size=128, seq_length=64, vocab_size=512)
    held, peak = one_process_step(cfg)
    est = activations.activation_memory(cfg, ParallelPlan.build(cfg, Layout()), 0, device_type="cpu")
    assert abs(est["activations"] / held - 1) < 0.01, (est["activations"], held)
    assert abs((est["activations"] + est["transient"]) / peak - 1) < 0.10, (est, peak)


@pytest.mark.parametrize("gate", [False, True])
def test_flops_count_the_shared_experts(gate):
    """The stages' FLOPs add up to the model's, and the shared expert adds 3 x 2 x 3 h S per token
    and MoE layer (a SwiGLU MLP of size S; the main MoE layers and the MTP depth, of the last
    layer's kind), its gate 3 x 2 h."""
    cfg = tiny(pipeline_model_parallel_size=2, moe_shared_expert_gate=gate)
    plan = ParallelPlan.for_world(cfg, 2)
    m, tokens = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    total = sum(timing.stage_flops_per_microbatch(cfg, plan, s) for s in range(2))
    logits_again = 2 * tokens * m.padded_vocab_size * m.hidden_size * (1 + m.mtp_num_layers)
    assert math.isclose(total, model_flops_per_token(m) * tokens + logits_again, rel_tol=1e-12)
    bare = tiny(moe_shared_expert_intermediate_size=None).model
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) + m.mtp_num_layers  # the depth: MoE
    per_layer = 3 * 2 * (3 * m.hidden_size * m.shared_expert_ffn_size + (m.hidden_size if gate else 0))
    assert model_flops_per_token(m) - model_flops_per_token(bare) == pytest.approx(moe_layers * per_layer)


def test_the_step_line_breaks_down_the_stage_that_sets_the_pipeline():
    """Stage 0 holds the dense layer and a MoE layer, stage 1 two MoE layers, the MTP depth and the
    head: stage 1 sets the pipeline's time, and the step line breaks down its micro-batch."""
    cfg = tiny(**PP2_EP2)
    plan = estimate.make_plan(cfg, 4, hardware.GPU_PRESETS["H800-80GB"])
    assert plan.pipeline_stage == 1
    t = [s.time_s for s in plan.stages]
    assert t[1]["compute_per_microbatch"] > t[0]["compute_per_microbatch"]
    text = format_plans({"real": plan})
    assert f"(per micro-batch, stage 1: compute {t[1]['compute_per_microbatch']:.3f}," in text


def test_the_mtp_depths_all_to_all_is_the_last_stages():
    """The last stage sends its MoE layers' and its MoE depth's rows: dispatch and combine, forward
    and backward, (EP - 1) / EP of them off the rank (the depth is never recomputed)."""
    cfg = tiny(**PP2_EP2, global_batch_size=8)
    plan = ParallelPlan.for_world(cfg, 4)
    m, n = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    mbs = 8 // (cfg.train.micro_batch_size * plan.layout.dp)
    per_layer = mbs * 4 * n * m.moe_router_topk * m.hidden_size * 4 / 2
    moe = [sum(m.is_moe_layer(i) for i in plan.stage(s).layers) for s in (0, 1)]
    assert moe == [1, 2]
    assert communication.communication(cfg, plan, 0)["ep"].bytes == moe[0] * per_layer
    assert communication.communication(cfg, plan, 1)["ep"].bytes == (moe[1] + m.mtp_num_layers) * per_layer
