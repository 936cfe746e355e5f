"""Helpers of the MoE tests: a tiny MoE layer, its inputs, and references written per token.

The per-token references are deliberately naive (Python loops over tokens, slots and experts,
reading expert e's weights as ``weight1[e]``) so they share no code with the batched layer.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.layer import MoELayer
from megatron_p2r.parallel.sharding import global_shape, init_parameters
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import expected_shard, tiny_config

HIDDEN = 32


def layer_values(**overrides) -> dict:
    """The model fields of the tiny MoE layer."""
    values = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_experts=4,
        moe_ffn_hidden_size=24,
        init_method_std=0.2,  # large init: routing probabilities far from uniform
        moe_router_topk=1,
        moe_router_pre_softmax=True,
    )
    return {**values, **overrides}


def layer_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**layer_values(**overrides))


def build_layer(
    cfg: ModelConfig,
    ps: ParallelState,
    seed: int = 3,
    modify: Optional[Callable[[MoELayer, ParallelState], None]] = None,
) -> MoELayer:
    return init_layer(MoELayer(cfg, ps), ps, seed, modify)


def init_layer(
    layer: MoELayer,
    ps: ParallelState,
    seed: int = 3,
    modify: Optional[Callable[[MoELayer, ParallelState], None]] = None,
) -> MoELayer:
    init_parameters(layer, seed, ps.tp_rank, ps.tp_size, ps.ep_rank)
    layer.router.weight.data.mul_(5.0)  # decisive routing: no near-ties between experts
    if modify is not None:
        modify(layer, ps)
    return layer


def layer_inputs(n: int, seed: int = 0, shapes=((2, 8), (1, 6), (3, 4), (1, 9))) -> List[tuple]:
    """(x, upstream gradient) pairs with different token counts (dropless splits vary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, s = shapes[i % len(shapes)]
        out.append((torch.randn(b, s, HIDDEN, generator=g), torch.randn(b, s, HIDDEN, generator=g)))
    return out


def random_biases(layer: MoELayer, ps: ParallelState) -> None:
    """Zero-initialised biases would hide bias bugs: give them values (this rank's slice of a
    layout-independent draw)."""
    g = torch.Generator().manual_seed(11)
    for b in (layer.experts.bias1, layer.experts.bias2, layer.router.bias):
        if b is not None:
            full = torch.randn(global_shape(b, ps.tp_size, ps.ep_size), generator=g) * 0.3
            b.data.copy_(expected_shard(full, b, ps))


def force_first_experts(x: torch.Tensor) -> torch.Tensor:
    """Inputs with a constant feature 0 that ``bias_router_towards`` turns into a router bias."""
    x = x.clone()
    x[..., 0] = 4.0
    return x


def bias_router_towards(first: int) -> Callable:
    """A router bias through feature 0: experts < ``first`` win, the others get nothing."""

    def modify(layer: MoELayer, ps: ParallelState) -> None:
        w = layer.router.weight.data
        w[:, 0] = -20.0
        w[:first, 0] = 20.0

    return modify


def layer_with_grad_buffers(
    overrides: dict, ps: ParallelState, modify: Optional[Callable[[MoELayer, ParallelState], None]] = None
):
    """(layer, ddp, model config): the MoE layer of ``layer_values(**overrides)`` with the gradient buffers
    training gives it — layer 0's MLP of a whole model built by ``build_train_state``, whose
    DDP reduces the layer's gradients with the rest of the stage — initialised as
    ``build_layer`` initialises a bare one."""
    from megatron_p2r.training import build_train_state

    cfg = tiny_config(
        **layer_values(**overrides), tensor_model_parallel_size=ps.tp_size, expert_model_parallel_size=ps.ep_size
    )
    state = build_train_state(cfg, ps)
    return init_layer(state.model.layers["0"].mlp, ps, modify=modify), state.ddp, cfg.model


def run_layer(layer: MoELayer, inputs: List[tuple]) -> List[torch.Tensor]:
    """Forward + backward of sum(out * g) averaged over ``inputs``; the outputs (detached)."""
    outs = []
    aux_loss.set_backward_scale(1.0 / len(inputs))  # as the schedules do: aux grads scale like the loss
    for x, g in inputs:
        out = layer(x)
        (out * g).sum().div(len(inputs)).backward()
        outs.append(out.detach())
    return outs


def layer_grads(layer: MoELayer) -> dict:
    """{name: gradient}: ``main_grad`` where the layer has gradient buffers, else ``.grad``."""
    return {n: getattr(p, "main_grad", p.grad).clone() for n, p in layer.named_parameters()}


# ----------------------------------------------------------------------------- references


def reference_routing(layer: MoELayer, x: torch.Tensor):
    """Per token: [(expert, weight)] in slot order, straight from the router's definition.
    Weights are float64 tensors differentiable w.r.t. the router weight and ``x``."""
    cfg_groups, topk = layer.router.groups, layer.router.topk
    W = layer.router.weight.double()
    per_group = layer.num_experts // cfg_groups
    out = []
    for t in range(x.shape[0]):
        logits = W @ x[t].double()
        if layer.router.bias is not None:  # megatron-core's (gpt-oss's) bias on the logits
            logits = logits + layer.router.bias.double()
        choices = []
        for grp in range(cfg_groups):
            probs = torch.softmax(logits[grp * per_group : (grp + 1) * per_group], 0)
            ranked = sorted(range(per_group), key=lambda e: -probs[e].item())[:topk]
            weights = [probs[e] for e in ranked]
            if layer.router.renormalize:
                total = sum(weights)
                weights = [w / total for w in weights]
            choices += [(grp * per_group + e, w) for e, w in zip(ranked, weights, strict=True)]
        out.append(choices)
    return out


def reference_expert(layer: MoELayer, e: int, v: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    y = ex.weight1[e].double() @ v.double()
    if ex.bias1 is not None:
        y = y + ex.bias1[e].double()
    if ex.activation.gated:  # SwiGLU (gpt-oss's quick-GeGLU: tests/model/test_gpt_oss.py)
        assert ex.activation.gate_function is F.silu
        y = F.silu(y[0::2]) * y[1::2]
    else:
        y = F.gelu(y, approximate=ex.activation.gelu_approximation)  # which GELU: tests/model/test_mlp.py
    y = ex.weight2[e].double() @ y
    if ex.bias2 is not None:
        y = y + ex.bias2[e].double()
    return y


def reference_kept(routing, num_experts: int, capacity: Optional[int], policy: str = "probs"):
    """Which (token, slot) assignments survive: each expert keeps ``capacity`` of those routed to
    it, megatron-core's way -- ``probs``: the largest weights; ``position``: the earliest tokens."""
    if capacity is None:
        return {(t, slot) for t, choices in enumerate(routing) for slot in range(len(choices))}
    by_expert = {}
    for t, choices in enumerate(routing):
        for slot, (e, w) in enumerate(choices):
            by_expert.setdefault(e, []).append((t, slot, float(torch.as_tensor(w).detach())))
    kept = set()
    for assignments in by_expert.values():
        if policy == "probs":
            assignments = sorted(assignments, key=lambda a: -a[2])
        kept.update((t, slot) for t, slot, _ in assignments[:capacity])
    return kept


def reference_layer(layer: MoELayer, x: torch.Tensor, capacity_factor: Optional[float] = None, policy: str = "probs"):
    """(output [T, h] float64, kept set, routing) by the per-token definition; the output is
    differentiable w.r.t. the layer's parameters and ``x`` (an independent backward)."""
    x = x.reshape(-1, x.shape[-1])
    routing = reference_routing(layer, x)
    slots = len(routing[0])
    capacity = None  # megatron-core's get_capacity(T * topk, E, factor)
    if capacity_factor is not None:
        capacity = math.ceil((x.shape[0] * slots / layer.num_experts) * capacity_factor)
    kept = reference_kept(routing, layer.num_experts, capacity, policy)
    rows = []
    for t, choices in enumerate(routing):
        row = torch.zeros(x.shape[1], dtype=torch.float64)
        for slot, (e, w) in enumerate(choices):
            if (t, slot) in kept:
                row = row + w * reference_expert(layer, e, x[t])
        rows.append(row)
    out = torch.stack(rows)
    return out, kept, routing
