"""The planner's bytes and FLOPs for multi-latent attention against what a rank allocates.

Activations: the bytes autograd keeps in a measured step (one process: fp32 and bf16, LayerNorm
and RMSNorm latents, no query latent, selective recomputation, attention dropout; TP2 with and
without sequence parallelism on 2 ranks) within 1% of the planner's count, the peak within 10%,
as tests/planning/test_planner.py does for standard attention. The kernel rule: CPU's flash kernel
needs one head dimension, so value heads of another width run the math kernel. Parameters: the
planner's per-rank tensors (layout/tensor_specs.py) are the model's, name by name, under TP2.
FLOPs: the stage's matmul FLOPs equal the sum counted from the layer's shapes by hand.
"""

import pytest
import torch

from megatron_p2r.layout import tensor_specs
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.metrics import model_flops_per_token
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.planning import activations, timing
from tests.harness import run_distributed
from tests.planning.test_planner import ACT_SHAPES, measure_step, one_process_step, small

MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8)
CASES = [
    dict(MLA, v_head_dim=10),  # no latent norms
    dict(MLA, v_head_dim=10, qk_layernorm=True),
    dict(MLA, v_head_dim=20, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope", swiglu=True),
    dict(MLA, v_head_dim=10, qk_layernorm=True, normalization="RMSNorm", bf16=True),
    dict(MLA, v_head_dim=10, qk_layernorm=True, q_lora_rank=None, bf16=True),
    dict(MLA, v_head_dim=10, qk_layernorm=True, recompute_activations=True),
    dict(MLA, v_head_dim=10, qk_layernorm=True, attention_dropout=0.1),
    dict(MLA, v_head_dim=20, qk_layernorm=True, normalization="RMSNorm", attention_dropout=0.1, bf16=True),
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if k not in MLA))
def test_activation_estimate_matches_measured_step(overrides):
    cfg = small(**{**ACT_SHAPES, **overrides})
    held, peak = one_process_step(cfg)
    est = activations.activation_memory(cfg, ParallelPlan.build(cfg, Layout()), 0, device_type="cpu")
    assert abs(est["activations"] / held - 1) < 0.01, (est["activations"], held)
    assert abs((est["activations"] + est["transient"]) / peak - 1) < 0.10, (est, peak)


@pytest.mark.parametrize("v_head_dim", [10, 20])
def test_math_kernel_rule_is_the_kernel_torch_picks_on_cpu(v_head_dim):
    cfg = small(**MLA, v_head_dim=v_head_dim)
    q = torch.randn(1, 2, 16, 20, requires_grad=True)
    y = torch.nn.functional.scaled_dot_product_attention(q, q, q[..., :v_head_dim], is_causal=True)
    assert ("FlashAttentionForCpu" in y.grad_fn.name()) != activations.latent_math_attention(cfg, "cpu")
    assert not activations.latent_math_attention(cfg, "cuda")


def _tp2_worker(rank, world):
    from megatron_p2r.parallel.state import initialize_plan
    from tests.helpers import random_microbatches

    out = {}
    for name, sp in (("tp2", False), ("tp2-sp", True)):
        cfg = small(**ACT_SHAPES, **CASES[3], tensor_model_parallel_size=2, sequence_parallel=sp)
        plan = ParallelPlan.for_world(cfg, world)
        ps = initialize_plan(plan, torch.device("cpu"))
        seed_everything(3, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps, plan)
        mb = random_microbatches(cfg, 1, cfg.train.micro_batch_size)[0]

        def step(tracker, mb=mb, model=model):
            loss = model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"])
            held = tracker.held()
            loss.backward()
            return held

        held, peak = measure_step(model, cfg, step)
        est = activations.activation_memory(cfg, plan, ps.pp_rank, device_type="cpu")
        specs = {s.name: s.shape for s in plan.tensors(ps.pp_rank)}
        params = {n: tuple(p.shape) for n, p in model.named_parameters()}
        out[name] = dict(held=held, peak=peak, est=est, specs=specs, params=params)
    return out


def test_tp2_activations_and_parameters_are_what_a_rank_allocates():
    for rank, r in enumerate(run_distributed(_tp2_worker, 2, timeout=300)):
        for name, res in r.items():
            est = res["est"]["activations"]
            assert abs(est / res["held"] - 1) < 0.01, (name, rank, est, res["held"])
            assert abs((est + res["est"]["transient"]) / res["peak"] - 1) < 0.10, (name, rank)
            assert res["specs"] == res["params"], (name, rank)
        assert r["tp2-sp"]["held"] < r["tp2"]["held"]


@pytest.mark.parametrize("sp", [False, True])
def test_flops_are_the_layer_shapes(sp):
    """Per token and layer: 2 x (every projection's weight a token meets on a rank; the replicated
    down-projections on each rank, for 1/TP of the tokens under sequence parallelism) + 2 x s x
    heads x (q head dim + v head dim) for the core."""
    cfg = small(**ACT_SHAPES, **CASES[1], tensor_model_parallel_size=2, sequence_parallel=sp)
    m, T = cfg.model, 2
    n, h, heads = cfg.train.micro_batch_size * m.seq_length, m.hidden_size, m.num_attention_heads
    down = h * (m.q_lora_rank + m.kv_lora_rank + m.qk_pos_emb_head_dim) / (T if sp else 1)
    per_rank = (
        down
        + m.q_lora_rank * heads * m.q_head_dim / T
        + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim) / T
        + heads * m.v_head_dim * h / T
    )
    core = 2 * m.seq_length * heads * (m.q_head_dim + m.v_head_dim) / T
    mlp = 2 * m.ffn_size * h / T
    head = 4 * 2 * m.padded_vocab_size * h / T  # the output layer, its logits recomputed in backward
    want = 3 * n * m.num_layers * (2 * per_rank + core + 2 * mlp) + n * head
    plan = ParallelPlan.for_world(cfg, 2)
    assert timing.stage_flops_per_microbatch(cfg, plan, 0) == pytest.approx(want, rel=1e-12)
    weights = (
        h * m.q_lora_rank
        + m.q_lora_rank * heads * m.q_head_dim
        + h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
        + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
        + heads * m.v_head_dim * h
        + 2 * m.ffn_size * h
    )
    per_token = 2 * (weights * m.num_layers + h * m.padded_vocab_size) + core * T * m.num_layers
    assert model_flops_per_token(m) == pytest.approx(3 * per_token, rel=1e-12)


def test_parameter_count_is_the_models():
    cfg = small(**CASES[2])
    model = build_model(cfg, ParallelState.single(), meta=True)
    specs = tensor_specs.stage_tensors(cfg.model, 1, 1, range(cfg.model.num_layers), True, True)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
