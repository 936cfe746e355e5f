"""DeepSeek-style routing in one process: group-limited top-k and the expert-bias update against
hand-worked examples, sigmoid scores (normalised over the chosen k, scaled), the bias that selects
but never weighs, the per-sequence auxiliary loss against a loop over sequences, the bias counted
once per micro-batch (also under recomputation) and never in evaluation, shared experts beside
the routed ones, and the configuration's refusals.

Tolerances: fp32 against float64 or hand-worked values: 1e-6 (observed ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.config import ConfigError, ModelConfig
from megatron_p2r.moe.expert_bias import updated_expert_bias
from megatron_p2r.moe.router import Router, group_limited_topk, load_balancing_loss, sequence_load_balancing_loss
from tests.moe.common import HIDDEN

TOL = 1e-6


def test_group_limited_topk_chooses_groups_by_the_sum_of_their_top_scores():
    # 4 groups of 2. Group sums of their top-2: A 0.9, B 1.2, C 1.0, D 0.2; by their best
    # expert (the wrong statistic) A and B would win.
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1]])
    values, indices = group_limited_topk(scores, topk=4, num_groups=4, group_topk=2)
    assert sorted(indices[0].tolist()) == [2, 3, 4, 5]
    assert values[0].tolist() == pytest.approx([0.6, 0.6, 0.5, 0.5])
    # topk / group_topk = 1: a group is scored by its best expert; then the top-2 of B and A
    values, indices = group_limited_topk(scores, topk=2, num_groups=4, group_topk=2)
    assert indices[0].tolist() == [0, 2] or indices[0].tolist() == [0, 3]
    # one group of 4 chosen by its top-2 sum (0.5 + 0.5 over 0.9 + 0.0): the best expert, 0, is out
    scores = torch.tensor([[0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]])
    values, indices = group_limited_topk(scores, topk=2, num_groups=2, group_topk=1)
    assert sorted(indices[0].tolist()) == [4, 5]


def test_expert_bias_moves_by_the_sign_of_the_load_error():
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 5.0]])  # means 2 and 2
    bias = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    new = updated_expert_bias(counts, bias, 1e-3)
    want = torch.tensor([[0.499, 0.501, 0.5, 0.5], [1e-3, 1e-3, 1e-3, -1e-3]])
    assert torch.allclose(new, want, atol=1e-7, rtol=0)
    # the step does not grow with the error
    assert updated_expert_bias(counts * 100, bias, 1e-3).tolist() == new.tolist()


def _router(**overrides) -> Router:
    values = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_experts=8,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        disable_bias_linear=True,  # DeepSeek-V3's router has no learned bias (gpt-oss's has: moe/router.py)
    )
    router = Router(ModelConfig(**{**values, **overrides}))
    torch.nn.init.normal_(router.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    return router


def _x(tokens: int = 6) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))


def test_sigmoid_weights_are_the_chosen_scores_normalised_and_scaled():
    router, x = _router(moe_router_topk_scaling_factor=2.5), _x()
    routing = router(x)
    scores = torch.sigmoid(x.double() @ router.weight.double().t())
    for t in range(x.shape[0]):
        chosen = sorted(range(8), key=lambda e: -scores[t, e].item())[:2]
        assert routing.indices[t].tolist() == chosen
        want = 2.5 * scores[t, chosen] / scores[t, chosen].sum()
        assert torch.allclose(routing.weights[t].double(), want, atol=TOL)
    # top-1: the raw score (a normalised single score would be 1 and give the router no gradient)
    top1 = _router(moe_router_topk=1)
    top1.weight.data.copy_(router.weight.data)
    assert torch.allclose(top1(x).weights[:, 0].double(), scores.max(-1).values, atol=TOL)


def test_expert_bias_selects_but_never_weighs():
    router, x = _router(moe_router_enable_expert_bias=True), _x()
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0]))  # expert 6 always chosen
    routing = router(x)
    scores = torch.sigmoid(x.double() @ router.weight.double().t())
    for t in range(x.shape[0]):
        assert 6 in routing.indices[t].tolist()
        chosen = routing.indices[t]
        want = scores[t, chosen] / scores[t, chosen].sum()  # the scores without the bias
        assert torch.allclose(routing.weights[t].double(), want, atol=TOL)
    assert not router.expert_bias.requires_grad
    assert "expert_bias" not in dict(router.named_parameters())
    assert "expert_bias" in router.state_dict()


def test_expert_bias_stays_fp32_when_the_model_is_cast():
    router = _router(moe_router_enable_expert_bias=True)
    router.expert_bias.fill_(1e-3 * 7)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert router.expert_bias[0].item() == pytest.approx(7e-3, abs=1e-9)  # not rounded to bf16


def test_aux_losses_count_the_unconstrained_top_k():
    """Megatron-LM's aux losses take each token's plain top-k of the scores, not the bias- or
    group-limited choice; sigmoid probabilities are normalised over all experts."""
    router, x = _router(moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1.0), _x()
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0]))
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    probs = scores / scores.sum(-1, keepdim=True)
    want = load_balancing_loss(probs.unsqueeze(1), probs.topk(2, dim=-1).indices)
    assert routing.aux_loss.item() == pytest.approx(want.item(), rel=TOL)


def test_sequence_aux_loss_is_the_switch_loss_of_each_sequence_averaged():
    router = _router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5)
    batch, seq = 3, 5
    x = _x(batch * seq)
    routing = router(x, batch=batch)
    want = 0.0
    for b in range(batch):
        tokens = slice(b * seq, (b + 1) * seq)
        scores = torch.sigmoid(x[tokens].double() @ router.weight.double().t())
        probs = scores / scores.sum(-1, keepdim=True)
        counts = torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=8).double()
        want += 8 * ((counts / (2 * seq)) * probs.mean(0)).sum() / batch  # E * sum f_e P_e
    assert routing.aux_loss.item() == pytest.approx(0.5 * want.item(), rel=TOL)
    # one sequence: the micro-batch loss
    probs = routing.probs.squeeze(1)
    idx = probs.topk(2, dim=-1).indices
    assert sequence_load_balancing_loss(probs, idx, 1).item() == pytest.approx(
        load_balancing_loss(probs.unsqueeze(1), idx).item(), rel=TOL
    )


@pytest.mark.parametrize(
    "values, match",
    [
        (dict(moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
        (dict(moe_router_group_topk=2), "needs --moe-router-num-groups"),
        (dict(moe_router_group_topk=2, moe_router_num_groups=3), r"divisible by --moe-router-num-groups \(3\)"),
        (dict(moe_router_group_topk=4, moe_router_num_groups=2), r"at most --moe-router-num-groups \(2\)"),
        (dict(moe_router_group_topk=4, moe_router_num_groups=4), r"--moe-router-topk \(2\) must be between"),
        (dict(moe_shared_expert_intermediate_size=16), "shared experts have no biases"),
        (
            dict(moe_router_score_function="sigmoid", moe_num_prototypes=2, moe_router_topk=1),
            "does not combine with --moe-num-prototypes",
        ),
    ],
)
def test_refusals(values, match):
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_experts=8, moe_router_topk=2)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**base, **values}).check()


DEEPSEEK = dict(
    num_experts=8,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=24,
    moe_shared_expert_gate=True,
    disable_bias_linear=True,
    swiglu=True,
)


@pytest.mark.parametrize("recompute", [False, True])
def test_each_assignment_is_counted_once_for_the_bias(recompute):
    """Counted in backward: once per micro-batch, also when recomputation runs the forward twice;
    an evaluation forward counts nothing."""
    from megatron_p2r.model.m6 import build_model
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
    from tests.helpers import random_microbatches, tiny_config

    cfg = tiny_config(**DEEPSEEK, recompute_activations=recompute)
    model = build_model(cfg, ParallelState.single())
    microbatches = random_microbatches(cfg, 2, 2)
    with torch.no_grad():
        model.eval()
        model(microbatches[0]["tokens"])
        model.train()
    routers = [layer.mlp.router for layer in model.layers.values()]
    assert all(r.tokens_per_expert.sum() == 0 for r in routers)
    forward_backward_no_pipelining(model, microbatches, ParallelState.single())
    tokens = 2 * 2 * cfg.model.seq_length
    assert [r.tokens_per_expert.sum().item() for r in routers] == [tokens * 2] * len(routers)


def test_shared_experts_add_their_gated_mlp_beside_the_routed_experts():
    from megatron_p2r.model.mlp import SharedExperts
    from megatron_p2r.moe.layer import MoELayer
    from megatron_p2r.parallel.sharding import init_parameters
    from megatron_p2r.parallel.state import ParallelState

    ps = ParallelState.single()
    cfg = ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, **DEEPSEEK)
    layer = MoELayer(cfg, ps, shared_experts=SharedExperts(cfg, ps))
    init_parameters(layer, 3, 0, 1, 0)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    shared = layer.shared_experts
    layer.shared_experts = None
    routed_only = layer(x)
    gate_up = x @ shared.fc1.weight.t()  # rows interleaved (gate_j, up_j), as the dense MLP's
    mlp = (torch.nn.functional.silu(gate_up[..., 0::2]) * gate_up[..., 1::2]) @ shared.fc2.weight.t()
    want = routed_only + torch.sigmoid(x @ shared.gate_weight.t()) * mlp
    assert torch.allclose(out, want, atol=1e-5)


def _three_steps(**overrides):
    from megatron_p2r.moe.expert_bias import biased_routers
    from megatron_p2r.parallel.state import ParallelState
    from tests.helpers import run_steps, tiny_config

    values = dict(DEEPSEEK, moe_router_topk=4, moe_router_bias_update_rate=1e-2, init_method_std=0.2)
    cfg = tiny_config(**values, **overrides)
    losses, state = run_steps(cfg, ParallelState.single(), 3)
    return losses, {k: r.expert_bias.clone() for k, r in biased_routers(state.model).items()}


@pytest.mark.parametrize(
    "overrides", [dict(cpu_offload_layers="0"), dict(recompute_activations=True)], ids=["offload", "recompute"]
)
def test_offload_and_recomputation_train_the_same(overrides):
    """Layer 0 offloaded (its router's bias stays with the model), or recomputed in full: the
    same losses and expert biases after 3 steps, bitwise."""
    losses, biases = _three_steps()
    other_losses, other_biases = _three_steps(**overrides)
    assert other_losses == losses
    assert all(torch.equal(other_biases[k], b) for k, b in biases.items()) and any(
        b.abs().sum() for b in biases.values()
    )


def test_compile_is_refused_by_name():
    from megatron_p2r.config.validation import validate
    from tests.helpers import tiny_config

    with pytest.raises(ConfigError, match="--compile with --moe-router-enable-expert-bias"):
        validate(tiny_config(**DEEPSEEK, compile=True), 1)
