"""The planner against the model: tensor-exact parameter counts (meta-device builds under the
fake process group), activation estimates against what a step really allocates on CPU, the
10T example's size, the offload and communication accounting, and a plan that does not fit.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from megatron_p2r.layout import tensor_specs
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning import activations, communication, estimate, hardware, memory, timing
from megatron_p2r.arguments import config_from_values, parse_args
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import Layout, ParallelState
from tests.harness import run_distributed
from tools.plan import verify_all_ranks, verify_rank

SMALL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=250,
    make_vocab_size_divisible_by=16,
    micro_batch_size=2,
    mock_data=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    moe_router_topk=1,
    moe_router_pre_softmax=True,
)
MOE = dict(num_experts=4, moe_ffn_hidden_size=96)
# DeepSeek-style routing (sigmoid, group-limited, the expert bias) with gated shared experts
DEEPSEEK = dict(
    moe_router_score_function="sigmoid",
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_enable_expert_bias=True,
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
)


def small(**overrides):
    return config_from_values({**SMALL, **overrides})


# ----------------------------------------------------------------------------- 10T


def test_10t_example_is_ten_trillion_parameters():
    cfg = parse_args(["--config", "examples/m6_10t/model.yaml", "examples/m6_10t/real.yaml"])
    total = memory.logical_parameter_count(ParallelPlan.for_world(cfg, 512))
    assert abs(total / 10e12 - 1) < 0.01, total
    experts = memory.expert_parameter_count(ParallelPlan.for_world(cfg, 512))
    weights = 2 * 1024 * 9984 * 10240 * 48
    assert experts == weights + (9984 + 1024) * 10240 * 48  # weights + both expert biases
    # the pseudo phase holds one layer's worth: a 48th of the experts
    pseudo = parse_args(["--config", "examples/m6_10t/model.yaml", "examples/m6_10t/pseudo.yaml"])
    assert memory.expert_parameter_count(ParallelPlan.for_world(pseudo, 512)) * 48 == experts


def test_10t_layouts_fit_512_v100s_devices_and_the_real_phase_overflows_their_hosts():
    gpu = hardware.GPU_PRESETS["V100-32GB"]
    for phase in ("pseudo", "real"):
        cfg = parse_args(["--config", "examples/m6_10t/model.yaml", f"examples/m6_10t/{phase}.yaml"])
        plan = estimate.make_plan(cfg, 512, gpu)
        assert plan.tiers["gpu"].fits and all(st.device_total <= gpu.memory for st in plan.stages)
        # the real phase's offloaded state is 2.6 TiB per 8-GPU node, the preset's node has 768 GiB
        assert plan.fits is plan.tiers["host"].fits is (phase == "pseudo"), plan.problems


# ----------------------------------------------------------------------------- meta builds

LAYOUTS = [
    ("tp2", dict(tensor_model_parallel_size=2), 4),
    ("pp2-tied", dict(pipeline_model_parallel_size=2), 4),
    (
        "tp2-pp2-ep2-moe",
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            moe_layer_freq=2,
            **MOE,
        ),
        8,
    ),
    (
        "pseudo-all-pp2-moe",
        dict(
            p2r_phase="pseudo",
            share_pattern="all",
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            moe_layer_freq=2,
            **MOE,
        ),
        4,
    ),
    (
        "pseudo-cycle2-pp4-tp2-untied",
        dict(
            p2r_phase="pseudo",
            share_pattern="cycle:2",
            pipeline_model_parallel_size=4,
            tensor_model_parallel_size=2,
            untie_embeddings_and_output_weights=True,
        ),
        8,
    ),
    (
        "tp2-sp-pp2-ep2-moe",
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            moe_layer_freq=2,
            **MOE,
        ),
        8,
    ),
    # SP with grouped-query attention (a key/value head replicated on both TP ranks), interleaved 1F1B
    (
        "tp2-sp-gqa-pp2-v2",
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            group_query_attention=True,
            num_query_groups=1,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
        ),
        4,
    ),
    (
        "real-ep4-swiglu-rope-rms-nobias",
        dict(
            expert_model_parallel_size=4,
            swiglu=True,
            position_embedding_type="rope",
            normalization="RMSNorm",
            disable_bias_linear=True,
            pipeline_layer_split="3,1",
            pipeline_model_parallel_size=2,
            **MOE,
        ),
        8,
    ),
    # key/value heads replicated over TP 4 (2 groups), q/k norms summed over TP, a pseudo slot on both stages
    (
        "gqa-tp4-g2-pseudo-pp2",
        dict(
            group_query_attention=True,
            num_query_groups=2,
            qk_layernorm=True,
            kv_channels=8,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=2,
            p2r_phase="pseudo",
            share_pattern="all",
        ),
        8,
    ),
    # OLMo 2: output norms on sequence shards, q/k norm weights split as the heads (key heads replicated)
    (
        "olmo2-tp4-g2-sp-pp2",
        dict(
            layer_norms="output",
            qk_layernorm=True,
            qk_layernorm_over_heads=True,
            normalization="RMSNorm",
            group_query_attention=True,
            num_query_groups=2,
            sequence_parallel=True,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=2,
        ),
        8,
    ),
    # gpt-oss: learned sink logits split with the heads, quick-GeGLU's fc1 as wide as SwiGLU's, the
    # router's bias replicated (partial gradients on sequence shards)
    (
        "gpt-oss-tp2-sp-pp2",
        dict(
            softmax_type="learnable",
            quick_geglu=True,
            sequence_parallel=True,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            moe_layer_freq=2,
            **MOE,
        ),
        4,
    ),
]


@pytest.mark.parametrize("name,overrides,world", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_planner_equals_meta_build(name, overrides, world):
    cfg = small(**overrides)
    out = verify_all_ranks(cfg, world)
    assert out["problems"] == []
    assert (
        out["logical_parameters"]
        == out["expected"]
        == memory.logical_parameter_count(ParallelPlan.for_world(cfg, world))
    )
    # the same logical count from the layout-free one-process model
    parallel = {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "pipeline_layer_split",
        "num_layers_per_virtual_pipeline_stage",
    }
    ref = small(**{k: v for k, v in overrides.items() if k not in parallel})
    assert (
        sum(p.numel() for p in build_model(ref, ParallelState.single(), meta=True).parameters())
        == memory.logical_parameter_count(ParallelPlan.for_world(ref, 1))
        == out["expected"]
    )
    for rank in (0, world - 1):
        r = verify_rank(cfg, world, rank)
        assert r["problems"] == []
        plan = ParallelPlan.for_world(cfg, world)
        stage = plan.layout.coords(rank).pp
        assert r["parameters"] == sum(s.numel for s in plan.tensors(stage))
        assert r["param_bytes"] == memory.stage_state_bytes(plan, stage)["params"]


def test_verification_catches_a_wrong_plan(monkeypatch):
    cfg = small(**MOE, expert_model_parallel_size=2)
    real = tensor_specs.layer_tensors

    def one_expert_too_many(m, key, tp, ep):
        return [
            s.__class__(**{**s.__dict__, "shape": (s.shape[0] + 1, *s.shape[1:])}) if s.expert else s
            for s in real(m, key, tp, ep)
        ]

    monkeypatch.setattr(tensor_specs, "layer_tensors", one_expert_too_many)
    problems = verify_rank(cfg, 2, 1)["problems"]
    assert any("weight1" in p for p in problems) and any("parameters" in p for p in problems)


# ----------------------------------------------------------------------------- activations


class AllocTracker(TorchDispatchMode):
    """Bytes of tensor storages created by ops and still alive (peak and current): every
    storage an op returns is counted once, until its last reference dies."""

    def __init__(self, existing=()):
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.live = self.peak = 0
        for t in existing:
            self.seen[t.untyped_storage()] = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self.seen:
                    n = st.nbytes()
                    self.seen[st] = n
                    self.live += n
                    weakref.finalize(st, self._free, n)
        self.peak = max(self.peak, self.live)
        return out

    def held(self) -> int:
        """Bytes alive now, once cyclic garbage is collected (its release would depend on when
        the collector runs) and, on several ranks, once the collectives already waited on have
        released their buffers (gloo's threads drop them a moment after the wait returns)."""
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            gc.collect()
        return self.live


def measure_step(model, cfg, step, microbatches=()) -> tuple:
    """(bytes held at the end of the forward, peak bytes of forward + backward) of ``step``,
    beyond the parameters and their (already allocated, as from the second step) gradients, and
    beyond the ``microbatches`` it reads (a view of their tensors is not an allocation)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = [t for mb in microbatches for t in mb.values()]
    tracker = AllocTracker([*model.parameters(), *(p.grad for p in model.parameters()), *inputs])
    with tracker:
        held = step(tracker)
    return held, tracker.peak


def one_process_step(cfg):
    m = cfg.model
    seed_everything(3, 0, 0, torch.device("cpu"))
    model = build_model(cfg, ParallelState.single())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (cfg.train.micro_batch_size, m.seq_length), generator=g)
    labels = torch.randint(0, m.vocab_size, tokens.shape, generator=g)

    def step(tracker):  # as training runs: in the weights' dtype (16-bit with --bf16), no autocast;
        # the loss as the schedules run it
        loss = model(tokens=tokens, labels=labels, loss_mask=torch.ones(tokens.shape))
        held = tracker.held()
        loss.backward()
        return held

    return measure_step(model, cfg, step)


FULL1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
BLOCK1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
ACTIVATION_CASES = [
    dict(),
    dict(bf16=True),
    dict(recompute_activations=True),  # selective: the attention core
    dict(bf16=True, **FULL1),
    dict(bf16=True, **BLOCK1),
    dict(
        swiglu=True, position_embedding_type="rope", normalization="RMSNorm", untie_embeddings_and_output_weights=True
    ),
    dict(bf16=True, hidden_dropout=0.1),
    dict(bf16=True, normalization="RMSNorm", swiglu=True, position_embedding_type="rope"),
    dict(bf16=True, p2r_phase="pseudo", share_pattern="all"),
    dict(p2r_phase="pseudo", share_pattern="cycle:2", **FULL2),
    # MoE with a capacity that every expert fills (equal counts: the planner assumes balance)
    dict(moe_capacity_factor=0.5, moe_layer_freq=2, **MOE),
    dict(bf16=True, moe_capacity_factor=0.5, moe_router_topk=2, moe_z_loss_coeff=0.01, **MOE),
    dict(bf16=True, moe_capacity_factor=0.5, **MOE, **FULL1),
    dict(bf16=True, p2r_phase="pseudo", share_pattern="all", moe_capacity_factor=0.5, **MOE),
    dict(moe_grouped_gemm=True, swiglu=True, moe_capacity_factor=0.5, moe_router_topk=2, **MOE),
    # padded to a capacity above the balanced share: every expert computes its capacity's rows
    dict(moe_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True, **MOE),
    dict(bf16=True, moe_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True, swiglu=True, **MOE, **FULL1),
    dict(
        bf16=True, swiglu=True, disable_bias_linear=True, moe_capacity_factor=0.5, moe_router_topk=2, **MOE, **DEEPSEEK
    ),
    # grouped-query attention, its norms and head sizes
    dict(group_query_attention=True, num_query_groups=2, kv_channels=16, qk_layernorm=True),
    dict(
        bf16=True,
        group_query_attention=True,
        num_query_groups=1,
        qk_layernorm=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        rotary_percent=0.5,
    ),
    dict(group_query_attention=True, num_query_groups=2, qk_layernorm=True, normalization="RMSNorm"),
    dict(group_query_attention=True, num_query_groups=2, qk_l2_norm=True, position_embedding_type="rope"),
    dict(bf16=True, qk_l2_norm=True, position_embedding_type="rope"),
    dict(qk_l2_norm=True),
    dict(bf16=True, group_query_attention=True, num_query_groups=2, position_embedding_type="rope"),
    # a vocabulary the loss walks in 4 chunks (tied: the embedding's gradient meets the output layer's)
    dict(vocab_size=16384, **FULL1),
    dict(bf16=True, vocab_size=16384, untie_embeddings_and_output_weights=True),
    # gpt-oss's activation (a clamp and an offset make new tensors of fc2's width) and sliding windows
    dict(
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.1,
        window_size="15,0",
        window_attn_skip_freq=2,
        position_embedding_type="rope",
        normalization="RMSNorm",
    ),
    dict(bf16=True, swiglu=True, activation_func_clamp_value=0.1),
    dict(bf16=True, quick_geglu=True, moe_capacity_factor=0.5, **MOE),
    # attention dropout: CPU runs SDPA's math kernel (s x s probabilities, mask, dropped, in fp32)
    dict(attention_dropout=0.1),
    dict(bf16=True, attention_dropout=0.1, hidden_dropout=0.1),
    dict(attention_dropout=0.1, recompute_activations=True),
    dict(bf16=True, attention_dropout=0.1, **FULL1),
    dict(attention_dropout=0.1, group_query_attention=True, num_query_groups=2, qk_layernorm=True),
    dict(
        bf16=True,
        attention_dropout=0.1,
        group_query_attention=True,
        num_query_groups=1,
        qk_layernorm=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
    ),
    dict(attention_dropout=0.1, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope"),
    dict(bf16=True, attention_dropout=0.1, seq_length=256, micro_batch_size=1),
    # OLMo 2: norms on the branch outputs, query/key norms over all heads; Gemma's norms on both
    dict(
        layer_norms="output",
        qk_layernorm=True,
        qk_layernorm_over_heads=True,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        group_query_attention=True,
        num_query_groups=2,
    ),
    dict(bf16=True, layer_norms="output", qk_layernorm=True, qk_layernorm_over_heads=True, normalization="RMSNorm"),
    dict(bf16=True, layer_norms="both", normalization="RMSNorm", **FULL1),
    # Gemma: soft-capped attention (the math block kernel: q, k, v, its [b, heads, s, d] output and
    # the log-sum-exp; with dropout the keep mask), soft-capped logits, tanh GeGLU
    dict(
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        geglu=True,
        layer_norms="both",
        normalization="RMSNorm",
        position_embedding_type="rope",
        attention_dropout=0.0,
    ),
    dict(bf16=True, attn_logit_softcapping=2.0, group_query_attention=True, num_query_groups=2, window_size="15,0"),
    dict(attn_logit_softcapping=2.0, attention_dropout=0.1, qk_layernorm=True, normalization="RMSNorm"),
    dict(bf16=True, attn_logit_softcapping=2.0, recompute_activations=True, geglu=True, **MOE, moe_capacity_factor=0.5),
    # Granite's multipliers: elementwise by a constant, nothing more saved
    dict(embedding_multiplier=3.0, residual_multiplier=0.5, softmax_scale=0.25, logits_scaling=2.0, bf16=True),
]
ACT_SHAPES = dict(
    num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, micro_batch_size=4
)


@pytest.mark.parametrize(
    "overrides", ACTIVATION_CASES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "fp32"
)
def test_activation_estimate_matches_measured_step(overrides):
    """Held bytes: exact by construction (1% allowed); peak: within 10% (the transient
    working set of backward is modelled, not replayed)."""
    cfg = small(**{**ACT_SHAPES, **overrides})
    held, peak = one_process_step(cfg)
    est = activations.activation_memory(cfg, ParallelPlan.build(cfg, Layout()), 0, device_type="cpu")
    est_held = est["activations"]
    assert abs(est_held / held - 1) < 0.01, (est_held, held)
    assert abs((est_held + est["transient"]) / peak - 1) < 0.10, (est_held + est["transient"], peak)


MOE_LAYER_CASES = [
    dict(moe_router_topk=2),
    dict(bf16=True, swiglu=True, moe_router_topk=2),
    dict(bf16=True, quick_geglu=True, moe_z_loss_coeff=0.01),
    dict(swiglu=True, moe_num_prototypes=2, disable_bias_linear=True),
    # Megatron-LM's default top-k weights: renormalised over the chosen k (the chosen and their sum kept)
    dict(moe_router_topk=2, moe_router_pre_softmax=False),
    # DeepSeek-style: sigmoid, group-limited, the expert bias, gated shared experts (fp32 and bf16)
    dict(swiglu=True, disable_bias_linear=True, moe_router_topk=2, **DEEPSEEK),
    dict(bf16=True, swiglu=True, disable_bias_linear=True, moe_router_topk=2, **DEEPSEEK),
]


@pytest.mark.parametrize("overrides", MOE_LAYER_CASES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_moe_layer_saves_what_the_planner_counts(overrides, monkeypatch):
    """Tensor by tensor: what each grouped, dropless MoE layer call saves for backward (distinct
    storages, its parameters and input aside) against the planner's count for that layer, to
    the byte but for tiny int32 and scalar tensors (the group ends, the z-loss). A layer's MoE
    part is its nodes from ``route`` to ``finish`` (moe/nodes.py), counted between the two."""
    from megatron_p2r.moe.layer import MoELayer

    cfg = small(**ACT_SHAPES, **MOE, moe_grouped_gemm=True, **overrides)
    route, finish, saved, open_counts = MoELayer.route, MoELayer.finish, [], []

    def counted_route(layer, x):
        # storages by identity, each kept alive while counted (the skipped ones too): between
        # route and finish a freed buffer's address is reused (the dispatch's rows; the layer's
        # input once route no longer needs it), which a key by address would merge
        kept = [t.untyped_storage() for t in (x, *layer.parameters())]
        seen, skip = {}, {storage._cdata: storage for storage in kept}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in skip:
                seen[storage._cdata] = (storage.nbytes(), storage)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        open_counts.append((hooks, seen))
        return route(layer, x)

    def counted_finish(layer, rows, weights, routed):
        out = finish(layer, rows, weights, routed)
        hooks, seen = open_counts.pop()
        hooks.__exit__(None, None, None)
        saved.append(sum(nbytes for nbytes, _ in seen.values()))
        return out

    monkeypatch.setattr(MoELayer, "route", counted_route)
    monkeypatch.setattr(MoELayer, "finish", counted_finish)
    one_process_step(cfg)
    a, n = activations.compute_bytes(cfg), cfg.train.micro_batch_size * cfg.model.seq_length
    held, _, _ = activations._moe_layer(cfg, n, n, 1, 1, a)
    if a == 4:  # the router's input is the layer's input itself (in 16-bit: its fp32 copy)
        held -= n * cfg.model.hidden_size * 4
    elif cfg.model.shared_expert_ffn_size:  # the shared experts keep the 16-bit input itself
        held -= n * cfg.model.hidden_size * a
    assert len(saved) == cfg.model.num_layers
    assert all(0 <= got - held <= 64 for got in saved), (held, saved)


def test_grouped_experts_hold_what_the_planner_counts_whatever_the_routing():
    """Dropless top-2 routing is imbalanced (random router): the grouped experts hold exactly the
    routed rows, as the planner counts; the padded ones pad every expert to the fullest one's
    count, which the planner's balanced routing does not see (measured +11% here)."""
    measured = {}
    for grouped in (True, False):
        cfg = small(**ACT_SHAPES, **MOE, bf16=True, moe_router_topk=2, moe_grouped_gemm=grouped)
        held, peak = one_process_step(cfg)
        est = activations.activation_memory(cfg, ParallelPlan.build(cfg, Layout()), 0, device_type="cpu")
        measured[grouped] = held, peak, est["activations"], est["activations"] + est["transient"]
    held, peak, est_held, est_peak = measured[True]
    assert abs(est_held / held - 1) < 0.01, (est_held, held)
    assert abs(est_peak / peak - 1) < 0.10, (est_peak, peak)
    held, _, est_held, _ = measured[False]
    assert held > 1.05 * est_held, (held, est_held)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_attention_is_the_kernel_torch_picks_on_cpu(dropout, dtype):
    """The planner's rule (math kernel with dropout, the fused CPU flash kernel without) against
    the backward node SDPA records when called as model/attention.py calls it."""
    cfg = small(attention_dropout=dropout)
    q = torch.randn(1, 2, 16, 8, dtype=dtype, requires_grad=True)
    y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout, is_causal=True)
    fused = "FlashAttentionForCpu" in y.grad_fn.name()
    assert fused != activations.math_attention(cfg, "cpu"), y.grad_fn.name()
    assert not activations.math_attention(cfg, "cuda")


def distributed_activation_worker(rank, world):
    """TP=2 (one forward/backward; also with sequence parallelism, alone and with full
    recomputation) and PP=2 (1F1B over 3 micro-batches: stage 0 keeps 2 in flight) measured
    on each rank, with the planner's estimate for that rank."""
    from megatron_p2r.parallel.state import initialize_plan
    from megatron_p2r.pipeline.schedules import get_forward_backward_func
    from tests.helpers import random_microbatches

    out = {}
    for name, overrides in (
        ("tp2", dict(tensor_model_parallel_size=2)),
        ("tp2-sp", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("tp2-sp-full", dict(tensor_model_parallel_size=2, sequence_parallel=True, **FULL1)),
        # capacity 0.25: every expert fills it (the planner assumes balanced routing)
        (
            "tp2-sp-moe",
            dict(
                tensor_model_parallel_size=2, sequence_parallel=True, moe_capacity_factor=0.25, moe_layer_freq=2, **MOE
            ),
        ),
        ("pp2", dict(pipeline_model_parallel_size=2, global_batch_size=12)),
    ):
        cfg = small(**ACT_SHAPES, bf16=True, **overrides)
        plan = ParallelPlan.for_world(cfg, world)
        ps = initialize_plan(plan, torch.device("cpu"))
        seed_everything(3, ps.tp_rank, ps.pp_rank, ps.device)
        model = build_model(cfg, ps, plan)
        mbs = random_microbatches(cfg, 3 if name == "pp2" else 1, cfg.train.micro_batch_size)

        def step(tracker, mbs=mbs, model=model, ps=ps):
            if name == "pp2":
                get_forward_backward_func(plan.schedule)(model, mbs, ps)
                return None
            loss = model(tokens=mbs[0]["tokens"], labels=mbs[0]["labels"], loss_mask=mbs[0]["loss_mask"])
            held = tracker.held()
            loss.backward()
            return held

        held, peak = measure_step(model, cfg, step)
        est = activations.activation_memory(cfg, plan, ps.pp_rank, device_type="cpu")
        out[name] = dict(held=held, peak=peak, est=est)
    return out


def test_activation_estimate_tp2_and_1f1b_in_flight():
    results = run_distributed(distributed_activation_worker, 2, timeout=240)
    for rank, r in enumerate(results):
        for case in ("tp2", "tp2-sp", "tp2-sp-full", "tp2-sp-moe"):
            tp = r[case]
            est_held = tp["est"]["activations"]
            assert abs(est_held / tp["held"] - 1) < 0.01, (case, rank, est_held, tp["held"])
            assert abs((est_held + tp["est"]["transient"]) / tp["peak"] - 1) < 0.10, (case, rank, tp)
        # sequence parallelism: 1/TP of the activations outside the TP regions
        assert r["tp2-sp"]["held"] < 0.8 * r["tp2"]["held"], r
        pp = r["pp2"]
        assert pp["est"]["in_flight"] == (2 if rank == 0 else 1)
        est_peak = pp["est"]["activations"] + pp["est"]["transient"]
        assert abs(est_peak / pp["peak"] - 1) < 0.10, (rank, est_peak, pp["peak"])


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_activations_against_korthikanti_table2():
    """Per layer, for the paper's 22B/175B/530B/1T shapes with no parallelism, TP 8, TP 8 + SP
    and selective recomputation: planner - formula is exactly the differences docs/scale.md
    explains (the norms' fp32 statistics; the fused attention's log-sum-exp instead of
    5as^2b); sequence parallelism divides everything by TP, as in the paper."""
    table = _benchmark("korthikanti_table")
    rows = list(table.rows())
    assert len(rows) == 20
    for name, variant, ours, paper, explained in rows:
        assert ours - paper == explained, (name, variant, ours, paper, explained)
    by = {(name, variant): ours for name, variant, ours, _, _ in rows}
    for name in table.MODELS:
        assert by[(name, "TP+SP")] * 8 == by[(name, "none")]


# ----------------------------------------------------------------------------- offload, comm, flops


def test_offload_plan_equals_offload_manager():
    from megatron_p2r.training import build_train_state

    for spec, extra in (
        ("2", {}),
        ("auto", dict(device_memory_budget="1500KiB")),
        ("1,3", {}),
        ("0.5", dict(cpu_offload_what="optimizer")),
    ):
        cfg = small(**MOE, moe_layer_freq=2, cpu_offload_layers=spec, **extra)
        got = build_train_state(cfg, ParallelState.single()).offload.describe()
        plan = memory.offload_plan(cfg, ParallelPlan.build(cfg, Layout()), 0)
        assert plan["device"] == got["device"] and plan["host"] == got["host"]
        assert plan["layers"] == got["layers"] and plan["modules"] == got["modules"] and plan["layers"]


def test_stage_flops_add_up_to_model_flops():
    from megatron_p2r.metrics import model_flops_per_token

    cfg = small(pipeline_model_parallel_size=2, swiglu=True, moe_layer_freq=2, **MOE)
    plan = ParallelPlan.for_world(cfg, 2)
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    total = sum(timing.stage_flops_per_microbatch(cfg, plan, s) for s in range(2))
    logits_again = 2 * tokens * cfg.model.padded_vocab_size * cfg.model.hidden_size  # the loss's backward
    assert math.isclose(total, model_flops_per_token(cfg.model) * tokens + logits_again, rel_tol=1e-12)
    # full recomputation adds one forward of every layer, selective one attention core
    core = 4 * tokens * cfg.model.seq_length * cfg.model.hidden_size
    for flags, extra in (
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            (model_flops_per_token(cfg.model, True) - model_flops_per_token(cfg.model)) * tokens
            - 2 * tokens * cfg.model.padded_vocab_size * cfg.model.hidden_size,
        ),
        (dict(recompute_activations=True), core * cfg.model.num_layers),
    ):
        rc = small(pipeline_model_parallel_size=2, swiglu=True, moe_layer_freq=2, **MOE, **flags)
        got = sum(timing.stage_flops_per_microbatch(rc, ParallelPlan.for_world(rc, 2), s) for s in range(2))
        assert math.isclose(got, total + extra, rel_tol=1e-12), flags


def test_communication_volumes():
    cfg = small(
        **MOE,
        expert_model_parallel_size=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        global_batch_size=16,
    )
    plan = ParallelPlan.for_world(cfg, 16)
    layout = plan.layout
    c0 = communication.communication(cfg, plan, 0, gpus_per_node=8)
    c1 = communication.communication(cfg, plan, 1, gpus_per_node=8)
    m, n = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    mbs = 16 // (cfg.train.micro_batch_size * layout.dp)
    # pipeline: stage 0 sends activations forward, stage 1 gradients back, fp32 [b, s, h]
    assert c0["pp"].bytes == c1["pp"].bytes == mbs * n * m.hidden_size * 4
    # all-to-all: each MoE layer dispatches and combines forward and backward, 3/4 leaves the rank
    moe_layers = 2
    assert c0["ep"].bytes == mbs * moe_layers * 4 * n * m.hidden_size * 4 * 3 / 4
    # tied embedding gradient: one all-reduce over (first, last stage) x DP 4 = 8 ranks
    vocab = m.padded_vocab_size // 2 * m.hidden_size * 4
    assert c0["embedding"].bytes == c1["embedding"].bytes == 2 * 7 / 8 * vocab
    assert c0["embedding"].size == 8
    # data-parallel: non-expert gradients of the stage over DP = 4
    dense = sum(s.numel for s in plan.tensors(0) if not s.expert and not plan.replica_stages(s.logical))
    assert c0["dp"].bytes == 2 * 3 / 4 * dense * 4
    assert c0["expert_dp"].bytes == 0  # EP = DP: every expert has one replica


def test_qk_norm_over_heads_communication():
    """--qk-layernorm-over-heads: per layer and micro-batch, the q and k norms each all-reduce one
    fp32 number per token over TP, and its gradient in backward."""
    base = dict(tensor_model_parallel_size=2, global_batch_size=8, qk_layernorm=True, normalization="RMSNorm")
    per_head, over = small(**base), small(**base, qk_layernorm_over_heads=True)
    plan = ParallelPlan.for_world(per_head, 2)
    tp = [communication.communication(cfg, plan, 0)["tp"].bytes for cfg in (per_head, over)]
    m, n = per_head.model, per_head.train.micro_batch_size * per_head.model.seq_length
    mbs = 8 // per_head.train.micro_batch_size
    assert tp[1] - tp[0] == mbs * m.num_layers * 2 * 2 * (n * 4) * 2 * 1 / 2  # ring all-reduce: 2 (T-1)/T


def test_sequence_parallel_communication():
    """Sequence parallelism: stages send 1/TP of the hidden states; the partial gradients
    (norms, row-parallel biases, position embedding) are summed over TP with their data-parallel
    copies, one reduction over "TP x DP" per step (``tp_partial``)."""
    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, global_batch_size=8)
    off, on = small(**base), small(**base, sequence_parallel=True)
    plans = {cfg is on: ParallelPlan.for_world(cfg, 4) for cfg in (off, on)}
    c_off, c_on = (communication.communication(cfg, plans[cfg is on], 0) for cfg in (off, on))
    assert c_on["pp"].bytes * 2 == c_off["pp"].bytes
    partial = [s_ for s_ in plans[True].tensors(0) if plans[True].reduction(s_.logical, s_.expert).tp_block == 2]
    names = {s_.name.split(".", 2)[-1] if s_.name.startswith("layers.") else s_.name for s_ in partial}
    assert names == {
        "input_norm.weight",
        "input_norm.bias",
        "post_attention_norm.weight",
        "post_attention_norm.bias",
        "attention.proj.bias",
        "mlp.fc2.bias",
        "embedding.position_embeddings.weight",
    }, names
    assert not any(plans[False].reduction(s_.logical, s_.expert).tp_block > 1 for s_ in plans[False].tensors(0))
    assert c_off["tp_partial"].bytes == 0 and c_on["tp_partial"].size == 2  # TP 2 x DP 1
    assert c_on["tp_partial"].bytes == pytest.approx(2 * 1 / 2 * sum(s_.numel for s_ in partial) * 4)


# ----------------------------------------------------------------------------- not fitting


def test_plan_that_does_not_fit_names_rank_and_category():
    cfg = parse_args(
        ["--config", "examples/m6_10t/model.yaml", "examples/m6_10t/real.yaml", "--cpu-offload-layers", "0"]
    )
    plan = estimate.make_plan(cfg, 512, hardware.GPU_PRESETS["V100-32GB"])
    assert not plan.fits and not plan.stages[0].fits
    assert plan.stages[0].overflow == "params"
    assert any("rank 0 (stage 0" in p and "overflows at 'params'" in p for p in plan.problems)
    # only the last pipeline stage overflows: a huge vocabulary's loss (a chunk of logits at a
    # time, far less than the [tokens, V] fp32 logits, but the output weight's 16-bit copy and gradient)
    cfg = small(
        pipeline_model_parallel_size=2,
        vocab_size=200_000,
        micro_batch_size=16,
        untie_embeddings_and_output_weights=True,
    )
    gpu = hardware.GPU_PRESETS["H100-80GB"].replace(memory=1300 * 2**20)
    plan = estimate.make_plan(cfg, 8, gpu)
    assert [st.fits for st in plan.stages] == [True, False]
    assert plan.stages[1].overflow == "transient"
    assert plan.stages[1].device["transient"] < 16 * 32 * cfg.model.padded_vocab_size * 4
    assert any("rank 4 (stage 1, ranks 4-7)" in p and "'transient'" in p for p in plan.problems)


def test_grouped_query_attention_flops_and_gradient_traffic():
    """Attention FLOPs count the query/output rows (heads x kv-channels) and the key/value rows
    (groups x kv-channels); with TP > groups each rank also computes its replicated key/value
    head. The replicas' and q/k norms' partial gradients are all-reduced over (TP block) x DP."""
    from megatron_p2r.metrics import model_flops_per_token

    gqa = dict(
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=8,
        qk_layernorm=True,
        tensor_model_parallel_size=4,
        global_batch_size=8,
        disable_bias_linear=True,
    )
    cfg = small(**gqa)
    m, (heads, groups, d, h, s) = cfg.model, (4, 2, 8, 64, 32)
    dense = small(**{**gqa, "num_query_groups": 4})
    per_layer = 2 * h * (heads * d + 2 * groups * d + heads * d)  # query, key/value, output projections
    delta = 3 * m.num_layers * 2 * h * 2 * (4 - groups) * d  # 2 fewer key/value heads, training
    assert model_flops_per_token(dense.model) - model_flops_per_token(m) == delta
    # doubling d doubles every attention term: projections and scores
    assert model_flops_per_token(small(**{**gqa, "kv_channels": 16}).model) - model_flops_per_token(
        m
    ) == 3 * m.num_layers * (per_layer + 4 * s * heads * d)
    plan = ParallelPlan.for_world(cfg, 8)  # TP 4 x DP 2: each key/value head on 2 TP ranks
    n = cfg.train.micro_batch_size * s
    ranks_total = 4 * timing.stage_flops_per_microbatch(cfg, plan, 0)
    logits_again = 2 * n * m.padded_vocab_size * h  # the loss recomputes its logits in backward
    assert math.isclose(
        ranks_total - model_flops_per_token(m) * n - logits_again,
        3 * m.num_layers * 2 * n * h * 2 * groups * d,
        rel_tol=1e-12,
    )  # the replicated key/value projection, computed twice
    traffic = communication.gradient_traffic(plan, 0)["tp_partial"]
    kv, norms = 2 * groups * d * h // 2, 4 * d  # per rank and layer: kv shard; q and k norms (LayerNorm weight, bias)
    assert traffic.size == 8 and traffic.bytes == pytest.approx(
        m.num_layers * (2 * 3 / 4 * kv * 4 + 2 * 7 / 8 * norms * 4)
    )
