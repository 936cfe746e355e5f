"""One-process MoE tests: routers against a per-token reference, capacity drops, aux losses,
fp32 routing with bf16 weights, jitter, recorded statistics, recomputation.

Tolerances: the layer runs in fp32 and the references in float64, so outputs agree to 1e-5
(observed ~1e-7); the aux and z losses to 1e-6 relative. Routing decisions are compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_p2r.config import ConfigError
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.dispatcher import plan
from megatron_p2r.moe.router import load_balancing_loss, z_loss
from megatron_p2r.parallel.state import ParallelState
from tests.moe.common import (
    build_layer,
    layer_cfg,
    layer_inputs,
    random_biases,
    reference_expert,
    reference_layer,
    reference_routing,
)

SINGLE = ParallelState.single()
OUT_TOL = 1e-5
BF16_REL = 2e-2  # bf16 layer against fp32 on the same weights: see test_router_is_fp32_with_bf16_weights

ROUTERS = {
    "top1": dict(moe_router_topk=1),
    "top2": dict(moe_router_topk=2),
    "top2-renorm-swiglu": dict(moe_router_topk=2, moe_router_pre_softmax=False, swiglu=True),
    "top3-of-8-nobias": dict(num_experts=8, moe_router_topk=3, disable_bias_linear=True),
    "prototypes2x3": dict(num_experts=6, moe_num_prototypes=2),
    "prototypes4x2-swiglu": dict(num_experts=8, moe_num_prototypes=4, swiglu=True),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_and_layer_match_per_token_reference(name):
    cfg = layer_cfg(**ROUTERS[name])
    layer = build_layer(cfg, SINGLE)
    random_biases(layer, SINGLE)
    for x, _ in layer_inputs(3):
        x2 = x.reshape(-1, x.shape[-1])
        routing = layer.router(x2)
        with torch.no_grad():
            want = reference_routing(layer, x2)
        assert routing.indices.tolist() == [[e for e, _ in c] for c in want]
        assert torch.allclose(
            routing.weights.double(),
            torch.tensor([[float(w) for _, w in c] for c in want], dtype=torch.float64),
            atol=1e-6,
        )
        with torch.no_grad():
            ref, kept, _ = reference_layer(layer, x)
        assert len(kept) == x2.shape[0] * routing.indices.shape[1]  # dropless: all kept
        out = layer(x)
        assert out.shape == x.shape
        assert (out.reshape(ref.shape).double() - ref).abs().max() < OUT_TOL


@pytest.mark.parametrize(
    "name,factor",
    [
        ("top1", None),
        ("top2-renorm-swiglu", None),
        ("top3-of-8-nobias", None),
        ("prototypes4x2-swiglu", None),
        ("top2", 0.5),
    ],
)
def test_gradients_match_per_token_reference(name, factor):
    """Backward of the batched layer (gathers, padding, all of it) against autograd through the
    float64 per-token reference: every parameter and the input (tolerance 1e-5, observed ~1e-7)."""
    cfg = layer_cfg(moe_capacity_factor=factor, **ROUTERS[name])
    layer = build_layer(cfg, SINGLE)
    random_biases(layer, SINGLE)
    x, g = layer_inputs(1, seed=12)[0]
    x.requires_grad_()
    (layer(x) * g).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    got_x = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref, kept, _ = reference_layer(layer, x, factor)
    (ref * g.reshape(ref.shape).double()).sum().backward()
    if factor is not None:
        assert len(kept) < x.shape[0] * x.shape[1] * cfg.moe_router_topk
    for n, p in layer.named_parameters():
        assert (got[n].double() - p.grad.double()).abs().max() < 1e-5, n
        assert torch.count_nonzero(p.grad) > 0, n
    assert (got_x.double() - x.grad.double()).abs().max() < 1e-5


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("routing", ["top1", "top2", "prototypes2x3"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_exactly_the_reference_tokens(routing, factor, policy):
    cfg = layer_cfg(moe_capacity_factor=factor, moe_token_drop_policy=policy, **ROUTERS[routing])
    layer = build_layer(cfg, SINGLE)
    random_biases(layer, SINGLE)
    x = layer_inputs(1, seed=4, shapes=((4, 8),))[0][0]
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        ref, kept, _ = reference_layer(layer, x, factor, policy)
    r = layer.router(x2)
    capacity = cfg.expert_capacity(x2.shape[0])
    p = plan(r.indices, cfg.num_experts, capacity, r.weights, policy)
    T = x2.shape[0]
    got = {(i % T, i // T) for i in p.order.tolist()}
    assert got == kept
    assert p.dropped == T * r.indices.shape[1] - len(kept)
    if factor == 0.5:
        assert p.dropped > 0  # the case must actually drop
    assert max(p.counts) <= capacity
    out = layer(x).reshape(ref.shape).double()
    assert (out - ref).abs().max() < OUT_TOL
    fully_dropped = [t for t in range(T) if not any((t, s) in kept for s in range(r.indices.shape[1]))]
    for t in fully_dropped:  # the residual carries these: the MoE output is exactly zero
        assert torch.count_nonzero(out[t]) == 0


def test_aux_and_z_loss_hand_computed():
    for overrides in (dict(moe_router_topk=2), dict(num_experts=6, moe_num_prototypes=2)):
        cfg = layer_cfg(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, **overrides)
        layer = build_layer(cfg, SINGLE)
        x = layer_inputs(1, seed=2)[0][0].reshape(-1, cfg.hidden_size)
        routing = layer.router(x)
        with torch.no_grad():
            ref = reference_routing(layer, x)
        T, G = x.shape[0], cfg.moe_num_prototypes
        n = cfg.num_experts // G
        W = layer.router.weight.detach().double()
        b = layer.router.bias.detach().double()  # the router's bias (biases on: Megatron's default)
        balance, zsum = 0.0, 0.0
        for grp in range(G):
            counts = [0] * n
            prob_sum = [0.0] * n
            for t in range(T):
                logits = W[grp * n : (grp + 1) * n] @ x[t].double() + b[grp * n : (grp + 1) * n]
                probs = torch.softmax(logits, 0)
                zsum += torch.logsumexp(logits, 0).item() ** 2
                for e in range(n):
                    prob_sum[e] += probs[e].item()
                for e, _ in ref[t]:
                    if grp * n <= e < (grp + 1) * n:
                        counts[e - grp * n] += 1
            assigned = sum(counts)
            balance += n * sum((counts[e] / assigned) * (prob_sum[e] / T) for e in range(n))
        balance /= G
        z = zsum / (T * G)
        assert math.isclose(load_balancing_loss(routing.probs, routing.indices).item(), balance, rel_tol=1e-6)
        assert math.isclose(z_loss(routing.logits).item(), z, rel_tol=1e-6)
        assert math.isclose(routing.aux_loss.item(), 0.1 * balance + 0.01 * z, rel_tol=1e-6)


def test_balanced_routing_has_unit_balancing_loss():
    probs = torch.full((8, 1, 4), 0.25)
    indices = torch.arange(8).remainder(4).unsqueeze(1)
    assert load_balancing_loss(probs, indices).item() == pytest.approx(1.0)


def test_aux_loss_gradient_reaches_the_router():
    """attach() adds d(aux)/d(router) to backward: equal to differentiating out*g + aux directly."""
    cfg = layer_cfg(moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x, g = layer_inputs(1, seed=5)[0]
    aux_loss.set_backward_scale(1.0)
    aux_loss.pop_recorded()
    layer = build_layer(cfg, SINGLE)
    (layer(x) * g).sum().backward()
    recorded = aux_loss.pop_recorded()
    assert len(recorded) == 1

    direct = build_layer(layer_cfg(moe_router_topk=2), SINGLE)  # same weights, no aux losses attached
    routing = direct.router(x.reshape(-1, cfg.hidden_size))
    aux = 0.1 * load_balancing_loss(routing.probs, routing.indices) + 0.01 * z_loss(routing.logits)
    assert routing.aux_loss is None
    ((direct(x) * g).sum() + aux).backward()
    assert recorded[0].item() == pytest.approx(aux.item(), rel=1e-6)
    assert torch.allclose(layer.router.weight.grad, direct.router.weight.grad, atol=1e-6)
    without = build_layer(layer_cfg(moe_router_topk=2), SINGLE)
    (without(x) * g).sum().backward()
    assert not torch.allclose(layer.router.weight.grad, without.router.weight.grad, atol=1e-4)


def test_router_is_fp32_with_bf16_weights():
    """With 16-bit weights, as --bf16 trains, the router computes in fp32 and the experts in
    bf16. Against the same layer in fp32 on the same weights and input (both bf16-representable):
    the same routing decisions; outputs and every gradient within BF16_REL of their tensor's
    largest fp32 magnitude (measured: outputs 5.6e-3, gradients 2.5e-3 for the router weight and
    8.0e-3 at worst, the second expert weight: a few bf16 roundings of 2^-9 each, on top of a
    bf16 input; a gradient off by a factor, or one not reaching the router, is far outside)."""
    cfg = layer_cfg(moe_router_topk=2)
    layer = build_layer(cfg, SINGLE).to(torch.bfloat16)
    fp32 = build_layer(cfg, SINGLE)
    with torch.no_grad():
        for p32, p16 in zip(fp32.parameters(), layer.parameters(), strict=True):
            p32.copy_(p16)
    x, g = layer_inputs(1, seed=6)[0]
    x = x.to(torch.bfloat16)
    routing = layer.router(x.reshape(-1, cfg.hidden_size))
    assert routing.logits.dtype == routing.weights.dtype == torch.float32
    assert routing.indices.tolist() == fp32.router(x.float().reshape(-1, cfg.hidden_size)).indices.tolist()
    out16, out32 = layer(x), fp32(x.float())
    assert out16.dtype == torch.bfloat16
    assert _relative_error(out16, out32) <= BF16_REL
    (out16.float() * g).sum().backward()
    (out32 * g).sum().backward()
    errors = {
        n: _relative_error(p16.grad, p32.grad)
        for (n, p16), p32 in zip(layer.named_parameters(), fp32.parameters(), strict=True)
    }
    assert max(errors.values()) <= BF16_REL, errors


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def test_jitter_only_in_training():
    cfg = layer_cfg(moe_router_topk=2, moe_input_jitter_eps=0.5)
    layer = build_layer(cfg, SINGLE)
    plain = build_layer(layer_cfg(moe_router_topk=2), SINGLE)
    x = layer_inputs(1, seed=7)[0][0].reshape(-1, cfg.hidden_size)
    layer.eval()
    assert torch.equal(layer.router(x).logits, plain.router(x).logits)
    layer.train()
    torch.manual_seed(0)
    a = layer.router(x).logits
    torch.manual_seed(0)
    b = layer.router(x).logits
    assert torch.equal(a, b)  # drawn from the default generator (identical on TP peers)
    assert not torch.allclose(a, plain.router(x).logits)
    ratio = ((a - plain.router(x).logits).abs() / plain.router(x).logits.abs()).max()
    assert ratio > 0.01


def test_routing_stats_recorded_in_training_only():
    cfg = layer_cfg(moe_router_topk=2, moe_capacity_factor=0.5)
    layer = build_layer(cfg, SINGLE)
    x = layer_inputs(1, seed=8, shapes=((4, 8),))[0][0]
    aux_loss.pop_routing_stats(torch.device("cpu"))
    layer.eval()
    layer(x)
    assert aux_loss.pop_routing_stats(torch.device("cpu")) is None
    layer.train()
    layer(x)
    layer(x)  # recorded twice (as under recomputation): same figures
    stats = aux_loss.pop_routing_stats(torch.device("cpu"))
    with torch.no_grad():
        _, kept, routing = reference_layer(layer, x, 0.5)
    assigned = 2 * x.shape[0] * x.shape[1]
    counts = [sum(1 for c in routing for e, _ in c if e == j) for j in range(cfg.num_experts)]
    share = assigned / cfg.num_experts
    assert stats["moe_dropped_fraction"] == pytest.approx(1 - len(kept) / assigned)
    assert stats["moe_min_load"] == pytest.approx(min(counts) / share)
    assert stats["moe_max_load"] == pytest.approx(max(counts) / share)


def test_experts_without_tokens_get_zero_gradients():
    cfg = layer_cfg(moe_router_topk=1)
    layer = build_layer(cfg, SINGLE)
    layer.router.weight.data[:, 0] = torch.tensor([30.0, -30.0, -30.0, -30.0])
    x, g = layer_inputs(1, seed=9)[0]
    x = x.clone()
    x[..., 0] = 3.0
    (layer(x) * g).sum().backward()
    assert torch.count_nonzero(layer.experts.weight1.grad[0]) > 0
    assert torch.count_nonzero(layer.experts.weight1.grad[1:]) == 0
    assert torch.count_nonzero(layer.experts.weight2.grad[1:]) == 0


def test_direct_expert_formula_uses_interleaved_swiglu():
    """Guard on the reference itself: expert 0 with swiglu equals the dense MLP formula."""
    cfg = layer_cfg(swiglu=True)
    layer = build_layer(cfg, SINGLE)
    random_biases(layer, SINGLE)
    v = torch.randn(cfg.hidden_size)
    w1, b1 = layer.experts.weight1[0].detach(), layer.experts.bias1[0].detach()
    y = w1 @ v + b1
    gate, up = y.view(-1, 2).unbind(-1)
    want = layer.experts.weight2[0].detach() @ (torch.nn.functional.silu(gate) * up) + layer.experts.bias2[0].detach()
    with torch.no_grad():
        assert torch.allclose(reference_expert(layer, 0, v).float(), want, atol=1e-5)


def test_drop_policies_on_a_hand_worked_example():
    """4 tokens, top-1 of 2 experts, --moe-expert-capacity-factor 0.5: capacity ceil(4 * 1 / 2 *
    0.5) = 1. Expert 0 gets tokens 0, 1, 3 (weights .6, .9, .8), expert 1 token 2: ``probs`` keeps
    token 1 (the largest weight), ``position`` token 0 (the earliest); expert 1 keeps token 2."""
    cfg = layer_cfg(num_experts=2, moe_router_topk=1, moe_capacity_factor=0.5)
    assert cfg.expert_capacity(4) == 1
    indices = torch.tensor([[0], [0], [1], [0]])
    weights = torch.tensor([[0.6], [0.9], [0.7], [0.8]])
    probs = plan(indices, 2, 1, weights, "probs")
    assert (probs.tokens.tolist(), probs.counts, probs.routed, probs.dropped) == ([1, 2], [1, 1], [3, 1], 2)
    assert plan(indices, 2, 1, weights, "position").tokens.tolist() == [0, 2]
    # top-2 over 3 tokens, capacity 2: expert 0 holds token 0's second choice (.3) and tokens
    # 1, 2's first (.5, .4): probs keeps tokens 1 and 2, position tokens 0 and 1
    indices = torch.tensor([[1, 0], [0, 1], [0, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.4, 0.35]])
    keep = {policy: plan(indices, 3, 2, weights, policy) for policy in ("probs", "position")}
    assert sorted(keep["probs"].tokens[:2].tolist()) == [1, 2] and keep["probs"].counts == [2, 2, 1]
    assert sorted(keep["position"].tokens[:2].tolist()) == [0, 1]


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_padding_to_capacity_is_the_same_math(factor):
    """--moe-pad-expert-input-to-capacity: every expert computes min(capacity, tokens) rows, the
    padding zero rows; the output and every gradient equal the unpadded layer's."""
    base = dict(moe_router_topk=2, moe_capacity_factor=factor, swiglu=True)
    outs = []
    for pad in (False, True):
        cfg = layer_cfg(moe_pad_expert_input_to_capacity=pad, **base)
        layer = build_layer(cfg, SINGLE)
        random_biases(layer, SINGLE)
        x, g = layer_inputs(1, seed=12)[0]
        x.requires_grad_()
        routed = layer.route(x)
        T = x.shape[0] * x.shape[1]
        if pad:
            assert routed.counts == [min(cfg.expert_capacity(T), T)] * cfg.num_experts
            assert routed.rows.shape[0] == sum(routed.counts) >= routed.order.numel()
        (layer.finish(layer.expert_rows(routed), routed.weights, routed) * g).sum().backward()
        outs.append([x.grad, *(p.grad for p in layer.parameters())])
    for unpadded, padded in zip(*outs, strict=True):
        torch.testing.assert_close(padded, unpadded, rtol=1e-6, atol=1e-7)


def test_padding_needs_a_capacity():
    with pytest.raises(ConfigError, match="--moe-pad-expert-input-to-capacity pads to a capacity"):
        layer_cfg(moe_pad_expert_input_to_capacity=True).check()


def test_router_bias_follows_the_linear_biases():
    """megatron-core's rule: a learned router bias with --add-bias-linear (no weight decay, as
    every bias), none with --disable-bias-linear or --no-moe-router-bias (how a checkpoint saved
    before the bias existed reads: checkpoint/metadata.py)."""
    from megatron_p2r.checkpoint.metadata import _upgraded

    assert build_layer(layer_cfg(), SINGLE).router.bias.no_wd
    assert build_layer(layer_cfg(disable_bias_linear=True), SINGLE).router.bias is None
    assert build_layer(layer_cfg(moe_router_bias=False), SINGLE).router.bias is None
    old = {"model": {"num_experts": 4}, "train": {}}
    assert _upgraded(old)["model"]["moe_router_bias"] is False
    assert _upgraded({"model": {"moe_router_bias": True}})["model"]["moe_router_bias"] is True
