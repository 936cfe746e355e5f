"""gpt-oss's features against transformers' own GptOssForCausalLM (the independent reference).

Megatron-LM trains gpt-oss with --window-size L,0 --window-attn-skip-freq 2 (sliding windows on
every other layer), --softmax-type learnable (a learned sink logit per head), --quick-geglu
--glu-linear-offset 1 --activation-func-clamp-value C (its clamped gated activation) in top-k
experts. A 2-layer model with those options and transformers' model with the same weights
(eager attention) give the same logits and the same gradients of the sinks, expert weights and
router bias (megatron-core's and transformers' bias on the router's logits):
in float64, except the rotary tables and the router, which are fp32 in both (so 1e-5, where a
missing option moves the logits by more than 1e-3). The clamp value is small enough that some
gates and linear halves are clamped; the window is shorter than the sequence.
"""

import pytest
import torch

from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import tiny_config

transformers = pytest.importorskip("transformers")

WINDOW, CLAMP, HEADS, GROUPS, D, H, F, E = 3, 0.5, 4, 2, 8, 32, 16, 4
OURS = dict(
    num_layers=2,
    hidden_size=H,
    num_attention_heads=HEADS,
    group_query_attention=True,
    num_query_groups=GROUPS,
    kv_channels=D,
    seq_length=12,
    vocab_size=208,
    make_vocab_size_divisible_by=16,
    position_embedding_type="rope",
    normalization="RMSNorm",
    norm_epsilon=1e-5,
    untie_embeddings_and_output_weights=True,
    window_size=f"{WINDOW},0",
    window_attn_skip_freq=2,
    softmax_type="learnable",
    quick_geglu=True,
    glu_linear_offset=1.0,
    activation_func_clamp_value=CLAMP,
    num_experts=E,
    moe_router_topk=2,
    moe_router_pre_softmax=False,
    moe_ffn_hidden_size=F,
)


def reference_model():
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2,
        hidden_size=H,
        intermediate_size=F,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=D,
        vocab_size=208,
        num_local_experts=E,
        num_experts_per_tok=2,
        sliding_window=WINDOW + 1,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=CLAMP,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # the router's bias too: ours under biases (moe/router.py)
                p.normal_(0.0, 0.5 if p.dim() == 1 else 0.3)
    return model


def load_reference(ours, ref) -> None:
    """Copy transformers' weights into ours (names and layouts of model/attention.py, moe/experts.py)."""
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        ours.embedding.word_embeddings.weight.copy_(theirs["model.embed_tokens.weight"])
        ours.output_layer.weight.copy_(theirs["lm_head.weight"])
        ours.final_norm.weight.copy_(theirs["model.norm.weight"])
        for i in range(2):
            t, o = f"model.layers.{i}.", ours.layers[str(i)]
            o.input_norm.weight.copy_(theirs[t + "input_layernorm.weight"])
            o.post_attention_norm.weight.copy_(theirs[t + "post_attention_layernorm.weight"])
            a = o.attention
            if a.softmax_offset is not None:
                a.softmax_offset.copy_(theirs[t + "self_attn.sinks"])
            for part in ("weight", "bias"):
                getattr(a.query, part).copy_(theirs[t + f"self_attn.q_proj.{part}"])
                k, v = theirs[t + f"self_attn.k_proj.{part}"], theirs[t + f"self_attn.v_proj.{part}"]
                kv = torch.stack([k.unflatten(0, (GROUPS, D)), v.unflatten(0, (GROUPS, D))], dim=1)
                getattr(a.key_value, part).copy_(kv.flatten(0, 2))  # [groups, (k, v), d] rows
                getattr(a.proj, part).copy_(theirs[t + f"self_attn.o_proj.{part}"])
            mlp = o.mlp
            mlp.router.weight.copy_(theirs[t + "mlp.router.weight"])
            mlp.router.bias.copy_(theirs[t + "mlp.router.bias"])
            x = mlp.experts  # transformers' gate_up columns are interleaved (gate_j, up_j), as our rows
            x.weight1.copy_(theirs[t + "mlp.experts.gate_up_proj"].transpose(1, 2))
            x.bias1.copy_(theirs[t + "mlp.experts.gate_up_proj_bias"])
            x.weight2.copy_(theirs[t + "mlp.experts.down_proj"].transpose(1, 2))
            x.bias2.copy_(theirs[t + "mlp.experts.down_proj_bias"])


def test_gpt_oss_layers_equal_transformers():
    ref = reference_model()
    cfg = tiny_config(**OURS)
    assert [cfg.model.attention_window(i) for i in range(2)] == [WINDOW, None]
    ours = build_model(cfg, ParallelState.single()).double()
    load_reference(ours, ref)
    tokens = torch.randint(0, 208, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_logits = ref(input_ids=tokens).logits
    logits = ours(tokens=tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    weights = torch.randn(ref_logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (ref_logits * weights).sum().backward()
    (logits * weights).sum().backward()
    theirs = dict(ref.named_parameters())
    for i in range(2):
        t, o = f"model.layers.{i}.", ours.layers[str(i)]
        torch.testing.assert_close(
            o.attention.softmax_offset.grad, theirs[t + "self_attn.sinks"].grad, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            o.mlp.experts.weight1.grad, theirs[t + "mlp.experts.gate_up_proj"].grad.mT, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(o.mlp.router.bias.grad, theirs[t + "mlp.router.bias"].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change",
    [
        dict(window_size=None, window_attn_skip_freq=None),
        dict(activation_func_clamp_value=None),
        dict(glu_linear_offset=0.0),
        dict(softmax_type="vanilla"),
    ],
)
def test_each_option_changes_the_logits(change):
    """Each option matters on this input, so the comparison above would see it missing."""
    ref = reference_model()
    tokens = torch.randint(0, 208, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = build_model(tiny_config(**{**OURS, **change}), ParallelState.single()).double()
    load_reference(ours, ref)
    assert (ours(tokens=tokens) - ref(input_ids=tokens).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(window_size="128"), "--window-size must be two integers 'L,0'"),
        (dict(window_size="128,4"), "--window-size 128,4: a causal model takes 'L,0'"),
        (dict(window_attn_skip_freq=2), "--window-attn-skip-freq needs --window-size"),
        (dict(swiglu=True, quick_geglu=True), "--swiglu and --quick-geglu are two activations"),
        (dict(glu_linear_offset=1.0), "--glu-linear-offset applies to a gated MLP"),
        (dict(activation_func_clamp_value=7.0), "--activation-func-clamp-value applies to a gated MLP"),
    ],
)
def test_options_are_checked(options, message):
    from megatron_p2r.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny_config(**options).model.check()


def test_window_layers_follow_megatron_and_transformers():
    """--window-attn-skip-freq N: layers N-1, 2N-1, ... (from 0) attend to everything, as
    Megatron-LM's is_layer_window_attention (from 1) and gpt-oss's layer_types."""
    m = tiny_config(num_layers=6, window_size="(127,0)", window_attn_skip_freq=3).model
    assert [m.attention_window(i) for i in range(6)] == [127, 127, None, 127, 127, None]
    assert [tiny_config(window_size="4,0").model.attention_window(i) for i in range(2)] == [4, 4]


def test_off_by_one_is_a_sink_logit_of_zero():
    """--softmax-type off-by-one adds exp(0) to each denominator: learnable offsets of 0."""
    tokens = torch.randint(0, 208, (2, 12), generator=torch.Generator().manual_seed(1))
    learnable = build_model(tiny_config(**OURS), ParallelState.single())
    off_by_one = build_model(tiny_config(**{**OURS, "softmax_type": "off-by-one"}), ParallelState.single())
    off_by_one.load_state_dict(learnable.state_dict(), strict=False)
    with torch.no_grad():
        for layer in learnable.layers.values():
            layer.attention.softmax_offset.zero_()
    vanilla = build_model(tiny_config(**{**OURS, "softmax_type": "vanilla"}), ParallelState.single())
    vanilla.load_state_dict(learnable.state_dict(), strict=False)
    assert torch.equal(off_by_one(tokens=tokens), learnable(tokens=tokens))
    assert not torch.allclose(vanilla(tokens=tokens), learnable(tokens=tokens))
