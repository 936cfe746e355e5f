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
