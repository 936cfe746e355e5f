"""Recomputation as Megatron-LM defines it reproduces no recomputation *bitwise* (fp32, attention
and hidden dropout on): selective (--recompute-activations: the attention core), full with
--recompute-method uniform (chunks of N layers) and block (the first N layers of the stage),
on a dense and a MoE model (router losses on) and in the pseudo phase (one module called by
every layer). Recomputed forwards replay both RNG streams, so the dropout masks, the loss and
every gradient are the same bits. That they recompute at all is seen in what autograd keeps:
fewer bytes selective, fewer still full. The units each method recomputes are pinned too.
"""

import pytest
import torch

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import forward_backward_no_pipelining
from tests.helpers import random_microbatches, tiny_config

RECOMPUTE = {
    "selective": dict(recompute_activations=True),
    "selective-granularity": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}
MODELS = {
    "dense": dict(),
    "moe": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_layer_freq=2,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
    ),
    "pseudo-all": dict(p2r_phase="pseudo", share_pattern="all"),
    # multi-latent attention: its core (value heads narrower than query/key heads) recomputed
    "mla": dict(
        multi_latent_attention=True,
        q_lora_rank=12,
        kv_lora_rank=8,
        qk_head_dim=6,
        qk_pos_emb_head_dim=4,
        v_head_dim=5,
        qk_layernorm=True,
    ),
    # a window on every other layer, learned sinks (recomputed with the core), clamped quick-GeGLU
    "gpt-oss": dict(
        window_size="5,0",
        window_attn_skip_freq=2,
        softmax_type="learnable",
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.1,
    ),
}


def _step(cfg):
    """Loss and gradients of one step of two micro-batches, the RNG seeded as training seeds it."""
    ps = ParallelState.single()
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    model = build_model(cfg, ps)
    loss = forward_backward_no_pipelining(model, random_microbatches(cfg, 2, 2), ps)
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model", MODELS)
def test_recomputation_reproduces_no_recomputation_bitwise(model):
    base = dict(num_layers=4, hidden_dropout=0.2, attention_dropout=0.3, **MODELS[model])
    loss, grads = _step(tiny_config(**base))
    for name, flags in RECOMPUTE.items():
        cfg = tiny_config(**base, **flags)
        validate(cfg, 1)
        got_loss, got = _step(cfg)
        assert torch.equal(got_loss, loss), (model, name)
        different = [n for n, g in grads.items() if not torch.equal(got[n], g)]
        assert not different, (model, name, different)


def _saved_bytes(cfg) -> int:
    """Bytes of the distinct storages autograd keeps for backward outside recomputed regions
    (checkpointed regions keep their own, which are dropped after the forward)."""
    storages = {}  # by address, each kept alive while counted: a freed one's address is reused

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage
        return t

    ps = ParallelState.single()
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    model = build_model(cfg, ps)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    mb = random_microbatches(cfg, 1, 2)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens=mb["tokens"], labels=mb["labels"])
    return sum(storage.nbytes() for ptr, storage in storages.items() if ptr not in params)


def test_recomputation_keeps_fewer_activations():
    base = dict(num_layers=4, attention_dropout=0.3, seq_length=64)  # attention dropout: s x s on CPU
    none, selective, full = (
        _saved_bytes(tiny_config(**base, **flags))
        for flags in ({}, RECOMPUTE["selective"], RECOMPUTE["full-uniform-1"])
    )
    assert full < selective < none, (none, selective, full)


def test_recompute_units_follow_megatron_methods():
    def units(**flags):
        cfg = tiny_config(num_layers=5, **flags)
        return cfg.train.recompute_units(5)

    plain = [([i], False) for i in range(5)]
    assert units() == units(recompute_activations=True) == plain  # selective: no whole layers
    assert units(**RECOMPUTE["full-uniform-3"]) == [([0, 1, 2], True), ([3, 4], True)]
    assert units(**RECOMPUTE["full-block-2"]) == [([0], True), ([1], True), ([2], False), ([3], False), ([4], False)]
    # offloaded layers (1, 3) recompute themselves: they leave their units
    standalone = tiny_config(num_layers=5, **RECOMPUTE["full-uniform-3"]).train.recompute_units(5, standalone=(1, 3))
    assert standalone == [([0], True), ([1], False), ([2], True), ([3], False), ([4], True)]
    assert tiny_config(recompute_activations=True).train.recompute == "selective"


def test_recompute_units_are_per_model_chunk_with_interleaving():
    """Megatron-LM applies the method to each virtual stage's block: block 1 recomputes the first
    layer of every model chunk of a rank (the model's and the planner's units alike)."""
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.parallel.state import Layout
    from megatron_p2r.planning.activations import recomputed_positions

    cfg = tiny_config(
        num_layers=8,
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=2,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
    )
    plan = ParallelPlan.build(cfg, Layout(pp=2))
    model = build_model(cfg, ParallelState(layout=Layout(pp=2), rank=0, device=torch.device("cpu")), plan, meta=True)
    assert model.recompute_units == [[([0], True), ([1], False)], [([2], True), ([3], False)]]
    assert recomputed_positions(cfg, plan.stage(0)) == {0, 2}


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(recompute_granularity="full"), "needs --recompute-method"),
        (dict(recompute_granularity="full", recompute_method="block"), "needs --recompute-method"),
        (dict(recompute_granularity="selective", recompute_num_layers=2), "full only"),
        (dict(recompute_method="uniform", recompute_num_layers=1), "full only"),
        (
            dict(
                recompute_activations=True,
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
            ),
            "conflicts",
        ),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0), "must be >= 1"),
    ],
)
def test_recompute_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**flags), 1)
