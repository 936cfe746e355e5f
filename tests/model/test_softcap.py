"""Gemma's model features against independent references: soft-capped attention against
transformers' own ``eager_attention_forward`` of Gemma 2 (the formula HF runs), the soft-capped
fused cross entropy against torch's cross entropy of C * tanh(logits / C), the tanh GeGLU
against gelu(gate, approximate='tanh') * up, and what soft-capped attention saves for backward
against the planner's count. (The whole models: tests/convert/hf/test_gemma.py.)"""

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_p2r.config import ConfigError
from megatron_p2r.model.attention import Attention, softcapped_attention
from megatron_p2r.moe.activation import Activation
from megatron_p2r.parallel.cross_entropy import output_cross_entropy
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.activations import compute_bytes, softcapped_core_bytes
from tests.helpers import tiny_config

transformers = pytest.importorskip("transformers")

B, HEADS, GROUPS, S, D, CAP = 2, 4, 2, 12, 8, 2.0


@pytest.mark.parametrize("window", [None, 3])
def test_softcapped_attention_matches_transformers_eager(window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, D, generator=g) * 2 for n in (HEADS, GROUPS, GROUPS))
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if window is not None:
        mask &= ~torch.ones(S, S, dtype=torch.bool).tril(-window - 1)
    additive = torch.zeros(S, S).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(head_dim=D, num_key_value_groups=HEADS // GROUPS, training=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs, _ = eager_attention_forward(module, *leaves, additive, scaling=0.3, softcap=CAP)
    theirs = theirs.transpose(1, 2)  # HF returns [b, s, heads, d]
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = softcapped_attention(*mine, window, 0.3, CAP, 0.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad = torch.randn(ours.shape, generator=g)
    (theirs * grad).sum().backward()
    (ours * grad).sum().backward()
    for a, b in zip(mine, leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    # the cap acts: without it the output is another
    assert (softcapped_attention(q, k, v, window, 0.3, 1e6, 0.0) - ours).abs().max() > 1e-2


@pytest.mark.parametrize("fused", [True, False])
def test_soft_capped_cross_entropy_matches_torch(fused):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    w = (torch.randn(40, 16, generator=g) * 0.8).requires_grad_()
    target = torch.randint(0, 40, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    logits = CAP * torch.tanh((x @ w.t()) / CAP)
    reference = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(2, 5)
    if fused:
        ours, reference = output_cross_entropy(x, w, target, None, loss_mask=mask, softcap=CAP), reference.sum()
    else:
        ours = output_cross_entropy(x, w, target, None, softcap=CAP)
    torch.testing.assert_close(ours, reference)
    grad = torch.randn(reference.shape, generator=g)
    gx, gw = torch.autograd.grad((reference * grad).sum(), (x, w))
    ox, ow = torch.autograd.grad((ours * grad).sum(), (x, w))
    torch.testing.assert_close(ox, gx)
    torch.testing.assert_close(ow, gw)


def test_geglu_is_tanh_gelu_gated():
    act = Activation(tiny_config(geglu=True).model)
    y = torch.randn(3, 10)
    gate, up = y[:, 0::2], y[:, 1::2]
    torch.testing.assert_close(act(y), F.gelu(gate, approximate="tanh") * up, rtol=0, atol=0)
    assert not act.is_swiglu


def _saved_bytes(module, x) -> int:
    """Bytes of the distinct storages one forward saves for backward (its input and parameters aside)."""
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(bf16=True, group_query_attention=True, num_query_groups=2, window_size="5,0"),
        dict(attention_dropout=0.1, bf16=True),
    ],
)
def test_softcapped_attention_saves_what_the_planner_counts(overrides):
    """Beyond what the fused kernel (SDPA) saves, soft-capped attention saves exactly the planner's
    ``softcapped_core_bytes``: the output projection's input copy (and the dropout keep mask)."""
    base = dict(dict(num_attention_heads=HEADS, hidden_size=32, seq_length=S, attention_dropout=0.0), **overrides)
    capped = tiny_config(**base, attn_logit_softcapping=CAP)
    dtype = torch.bfloat16 if capped.train.bf16 else torch.float32
    x = torch.randn(B, S, 32).to(dtype)
    saved = {}
    for name, cfg in (("fused", tiny_config(**dict(base, attention_dropout=0.0))), ("capped", capped)):
        torch.manual_seed(0)
        module = Attention(cfg.model, ParallelState.single(), window=cfg.model.attention_window(0)).to(dtype)
        saved[name] = _saved_bytes(module.train(), x)
    q, a = B * S * HEADS * capped.model.head_dim, compute_bytes(capped)
    # with a window SDPA also saves its additive [s, s] mask, which the planner leaves out (s^2 bytes a layer)
    fused_mask = S * S * a if capped.model.window_size else 0
    assert saved["capped"] - saved["fused"] + fused_mask == softcapped_core_bytes(capped, q, a)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attn_logit_softcapping=2.0, softmax_type="learnable"), "--attn-logit-softcapping with --softmax-type"),
        (dict(rotary_base_local=100.0, position_embedding_type="rope"), "--rotary-base-local is the rotary base"),
        (dict(geglu=True, swiglu=True), "--swiglu and --geglu are two activations"),
        (dict(attn_logit_softcapping=-1.0), "attn-logit-softcapping"),
        (
            dict(attn_logit_softcapping=2.0, context_parallel_size=2, seq_length=16),
            "--context-parallel-size 2 is not built with --attn-logit-softcapping",
        ),
    ],
)
def test_gemma_options_are_checked(overrides, message):
    from megatron_p2r.config.validation import validate

    with pytest.raises(ConfigError, match=message):
        cfg = tiny_config(**overrides)
        validate(cfg, world_size=2 if "context_parallel_size" in overrides else 1)
