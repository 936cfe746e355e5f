"""The layout's tensor specs against the model they describe: the transformer module each
parameter belongs to is carried on its spec, so no reader parses it out of the name."""

import pytest

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
        dict(
            num_layers=6,
            pipeline_model_parallel_size=2,
            p2r_phase="pseudo",
            share_pattern="cycle:2",
            num_experts=4,
            moe_layer_freq=2,
        ),
    ],
)
def test_each_spec_carries_the_module_that_holds_its_parameter(overrides):
    cfg = tiny_config(**overrides)
    layout = Layout(pp=cfg.parallel.pipeline_model_parallel_size)
    plan = ParallelPlan.build(cfg, layout)
    for stage in range(layout.pp):
        model = build_model(cfg, ParallelState(layout=layout, rank=stage), plan, meta=True)
        owner = {id(p): int(key) for key, module in model.layers.items() for p in module.parameters()}
        built = [owner.get(id(p)) for _, p in model.named_parameters()]
        assert built == [s.module_key for s in plan.tensors(stage)]
        assert any(k is not None for k in built) and None in built


def test_shared_experts_specs_are_what_a_rank_builds():
    """Names, local shapes and TP dims of a DeepSeek-style MoE layer (gated shared experts TP-split
    like the dense MLP, the router's bias a buffer: not a parameter) on a TP2 x EP2 rank; the
    gate is applied to sequence shards under sequence parallelism (a partial gradient)."""
    cfg = tiny_config(
        num_experts=4,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
        disable_bias_linear=True,
        swiglu=True,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        sequence_parallel=True,
    )
    layout = Layout(tp=2, dp=2, ep=2)
    plan = ParallelPlan.build(cfg, layout)
    model = build_model(cfg, ParallelState(layout=layout, rank=0), plan, meta=True)
    built = [(n, tuple(p.shape), getattr(p, "tp_dim", None)) for n, p in model.named_parameters()]
    assert built == [(t.name, t.shape, t.tp_dim) for t in plan.tensors(0)]
    shared = {t.name: t for t in plan.tensors(0) if ".shared_experts." in t.name}
    assert shared["layers.0.mlp.shared_experts.fc1.weight"].shape == (32, 32)  # 2 x 32 / TP2, h
    assert shared["layers.0.mlp.shared_experts.fc2.weight"].shape == (32, 16)
    assert shared["layers.0.mlp.shared_experts.gate_weight"].tp_partial
