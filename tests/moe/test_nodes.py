"""A MoE layer's nodes (moe/nodes.py), run one autograd graph each as the overlapped schedule runs
them, and the layer's ordinary forward (the same nodes in one graph) both compute the layer written
plainly, x + attn(norm(x)) then + moe(norm(.)), bitwise: output, input gradient, weight gradients.
One process: the all-to-alls go over an EP group of one rank (real all-to-alls, to itself)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_p2r.model.block import TransformerLayer
from megatron_p2r.model.nodes import leaf, node_backward
from megatron_p2r.moe.dispatcher import Dispatcher
from megatron_p2r.parallel.mappings import all_to_all
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.sharding import init_parameters
from megatron_p2r.parallel.state import ParallelState
from tests.moe.common import layer_cfg

CPU = torch.device("cpu")


@pytest.fixture
def one_rank_group():
    """An EP group of this process alone (no test leaves a process group open: tests/conftest.py)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()


def _layer(**overrides) -> TransformerLayer:
    cfg = layer_cfg(
        hidden_dropout=0.1,
        attention_dropout=0.1,
        moe_input_jitter_eps=0.1,
        moe_router_topk=2,
        position_embedding_type="learned_absolute",
        **overrides,
    )
    layer = TransformerLayer(cfg, ParallelState.single(), moe=True)
    init_parameters(layer, 3, 0, 1, 0)
    layer.mlp.router.weight.data.mul_(5.0)  # decisive routing
    return layer


def _plain(layer: TransformerLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer written plainly, its MoE MLP without all-to-alls (EP=1)."""
    d = layer.mlp.dispatcher
    layer.mlp.dispatcher = Dispatcher(d.num_experts, 1, None)
    try:
        residual = layer.attend(x)
        return layer.add_mlp(residual, layer.mlp(layer.post_attention_norm(residual)))
    finally:
        layer.mlp.dispatcher = d


def _node_by_node(layer: TransformerLayer, x: torch.Tensor, grad: torch.Tensor, recompute: bool) -> torch.Tensor:
    """The nodes one graph each, their inputs leaves, backward node by node (as pipeline/a2a_overlap.py)."""
    nodes = layer.nodes().recompute(CPU) if recompute else layer.nodes()
    residual, routed = nodes.pre(x, None)
    handle = nodes.exchange(routed)
    received = leaf(all_to_all(routed.rows.detach(), *handle.dispatch_splits, nodes.group))
    expert_out = nodes.experts(received, handle)
    rows = leaf(all_to_all(expert_out.detach(), *handle.combine_splits, nodes.group))
    residual_in, weights = leaf(residual), leaf(routed.weights)
    out = nodes.post(rows, residual_in, weights, routed)
    node_backward([out], [grad])
    node_backward([expert_out], [all_to_all(rows.grad, *handle.dispatch_splits, nodes.group)])
    node_backward(
        [residual, routed.weights, routed.rows],
        [residual_in.grad, weights.grad, all_to_all(received.grad, *handle.combine_splits, nodes.group)],
    )
    return out


def _run(layer: TransformerLayer, how: str, x: torch.Tensor, grad: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    seed_everything(7, 0, 0, CPU)  # every run draws the same dropout and jitter
    x = leaf(x)
    if how.startswith("nodes"):
        out = _node_by_node(layer, x, grad, recompute=how == "nodes/recomputed")
    else:
        out = layer(x) if how == "forward" else _plain(layer, x)
        out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("overrides", [{}, dict(moe_capacity_factor=0.5, swiglu=True)], ids=["dropless", "drops"])
def test_the_nodes_and_the_forward_are_the_layer_bitwise(one_rank_group, overrides):
    layer = _layer(**overrides)
    layer.mlp.dispatcher = Dispatcher(layer.mlp.num_experts, 1, one_rank_group)  # EP over one rank
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    want = _run(layer, "plain", x, grad)
    for how in ("forward", "nodes", "nodes/recomputed"):
        out, x_grad, grads = _run(layer, how, x, grad)
        assert torch.equal(out, want[0]) and torch.equal(x_grad, want[1]), how
        assert [n for n in grads if not torch.equal(grads[n], want[2][n])] == [], how


def test_a_layer_without_all_to_alls_has_no_nodes():
    assert _layer().nodes() is None  # EP=1: it runs whole, one node
    dense = TransformerLayer(layer_cfg(), ParallelState.single(), moe=False)
    assert dense.nodes() is None
