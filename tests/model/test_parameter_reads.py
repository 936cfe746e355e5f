"""Every parameter is read inside the forward of the module that owns it. The overlapped
parameter all-gather (``--overlap-param-gather``, parallel/ddp.py) waits for a module's buckets
in that module's forward pre-hook, so a weight read from elsewhere (the tied output layer of the
last pipeline stage was once read by the model directly) could be read before its gather landed:
a race that showed as a rare 4e-4 loss difference in the PP2 x DP2 distributed-optimizer test."""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import random_microbatches, tiny_config

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
CASES = {
    "tied": {},
    "untied": dict(untie_embeddings_and_output_weights=True),
    "pp3-tied": dict(pipeline_model_parallel_size=3, num_layers=3),
    "pp3-untied": dict(pipeline_model_parallel_size=3, num_layers=3, untie_embeddings_and_output_weights=True),
    "pp2-interleaved-pseudo": dict(
        pipeline_model_parallel_size=2,
        num_layers=4,
        num_layers_per_virtual_pipeline_stage=1,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
    ),
    "moe": MOE,
    "moe-grouped-gemm": dict(moe_grouped_gemm=True, **MOE),
    "gqa-swiglu": dict(num_query_groups=2, group_query_attention=True, swiglu=True),
}


def _poisoned_forward(model, real: dict, chunk: int, inputs: dict) -> torch.Tensor:
    """The stage's output with every parameter NaN until its own module's forward pre-hook puts
    back its value from ``real``."""
    with torch.no_grad():
        for p in real:
            p.fill_(float("nan"))

    def restore(module, args, kwargs):
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.copy_(real[p])

    handles = [
        m.register_forward_pre_hook(restore, with_kwargs=True)
        for m in model.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
    try:
        return model(chunk=chunk, **inputs)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_parameter_is_read_in_its_own_modules_forward(case):
    cfg = tiny_config(**CASES[case])
    layout = Layout(pp=cfg.parallel.pipeline_model_parallel_size)
    plan = ParallelPlan.build(cfg, layout)
    batch = random_microbatches(cfg, 1, 2)[0]
    for rank in range(layout.world_size):
        ps = ParallelState(layout=layout, rank=rank)
        model = build_model(cfg, ps, plan)
        real = {p: p.detach().clone() for p in model.parameters()}
        for chunk, spec in enumerate(plan.stage(rank).chunks):
            inputs = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]} if spec.last else {}
            if spec.first:
                inputs["tokens"] = batch["tokens"]
            else:
                shape, dtype = model.hidden_spec(tuple(batch["tokens"].shape))
                inputs["hidden"] = torch.randn(shape, dtype=dtype)
            out = _poisoned_forward(model, real, chunk, inputs)
            assert torch.isfinite(out).all(), f"stage {rank} chunk {chunk} read a weight outside its module's forward"
