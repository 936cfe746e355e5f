"""Megatron's saved args -> our model options: Megatron's names (old and new) and defaults, every
inexpressible option named in one message, and the vocabulary padding kept."""

import os
import tracemalloc

import pytest

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.args import MegatronConversionError, SavedArgs, model_values, vocab_values
from megatron_p2r.config import ModelConfig
from tests.convert.megatron.fixtures import GPT, LLAMA, MIXTRAL, megatron_args


def saved(spec, tp=2, pp=1, ep=1, **overrides):
    return SavedArgs.of(megatron_args(spec, tp, pp, ep, **overrides), "common.pt")


def test_families_map_to_our_options():
    gpt, _, _ = model_values(saved(GPT))
    assert gpt == dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        disable_bias_linear=False,
        position_embedding_type="learned_absolute",
        rotary_base=10000.0,
        rotary_percent=1.0,
        max_position_embeddings=16,
        seq_length=16,
        untie_embeddings_and_output_weights=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        qk_layernorm=False,
        qk_l2_norm=False,
        add_qkv_bias=False,
        bias_gelu_fusion=True,
        softmax_type="vanilla",
        quick_geglu=False,
    )
    llama, one_p, notes = model_values(saved(LLAMA))
    assert {
        k: llama[k]
        for k in (
            "normalization",
            "swiglu",
            "position_embedding_type",
            "disable_bias_linear",
            "group_query_attention",
            "num_query_groups",
            "kv_channels",
            "rotary_percent",
            "qk_layernorm",
            "add_qkv_bias",
        )
    } == dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        rotary_percent=0.5,
        qk_layernorm=True,
        add_qkv_bias=False,
    )
    assert one_p
    assert "gamma - 1" in notes[0]
    moe, _, _ = model_values(saved(MIXTRAL, ep=2))
    assert {
        k: moe[k] for k in ("num_experts", "moe_router_topk", "moe_router_pre_softmax", "moe_aux_loss_coeff")
    } == dict(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=False, moe_aux_loss_coeff=1e-2)
    pre_softmax, _, _ = model_values(saved(MIXTRAL, moe_router_pre_softmax=True, moe_layer_freq=[1, 1, 1, 1]))
    assert pre_softmax["moe_router_pre_softmax"] is True


def test_older_names_and_megatron_defaults():
    """Older Megatron: norm_epsilon / apply_layernorm_1p / use_rotary_position_embeddings; an
    arg missing from the checkpoint takes Megatron's default (dropout 0.1, biases on)."""
    a = SavedArgs(
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 8,
            "max_position_embeddings": 8,
            "norm_epsilon": 1e-6,
            "apply_layernorm_1p": True,
            "use_rotary_position_embeddings": True,
            "swiglu": True,
            "bias_swiglu_fusion": True,
        },
        "x.pt",
    )
    values, one_p, _ = model_values(a)
    assert (
        values["norm_epsilon"],
        values["position_embedding_type"],
        values["hidden_dropout"],
        values["disable_bias_linear"],
        one_p,
    ) == (1e-6, "rope", 0.1, False, True)


def test_every_blocking_option_is_named():
    a = saved(
        LLAMA,
        rotary_interleaved=True,
        position_embedding_type="yarn",
        apply_residual_connection_post_layernorm=True,
        moe_router_score_function="sigmoid",
    )
    with pytest.raises(MegatronConversionError) as err:
        model_values(a)
    message = str(err.value)
    assert message.startswith("common.pt: cannot express this Megatron-LM model here: ")
    for part in (
        "--rotary-interleaved True (interleaved rotary embeddings",
        "--position-embedding-type yarn",
        "--apply-residual-connection-post-layernorm True",
        "--moe-router-score-function 'sigmoid'",
    ):
        assert part in message
    with pytest.raises(
        MegatronConversionError, match=r"--moe-layer-freq 2 \(MoE layers \[1, 0, 1, 0\]: reading .* mixed"
    ):
        model_values(saved(MIXTRAL, moe_layer_freq=2))
    with pytest.raises(MegatronConversionError, match="--moe-router-load-balancing-type sinkhorn"):
        model_values(saved(MIXTRAL, moe_router_load_balancing_type="sinkhorn"))


GPT_OSS = dict(
    swiglu=False,
    quick_geglu=True,
    glu_linear_offset=1.0,
    activation_func_clamp_value=7.0,
    softmax_type="learnable",
    window_size=(127, 0),
)


@pytest.mark.parametrize(
    "freq,ours",
    [
        (2, 2),
        (None, None),
        ([1, 1, 1, 1], None),  # Megatron's per-layer pattern (1: windowed): every layer windowed
        ([1, 0, 1, 0], [1, 0, 1, 0]),  # read as the list (1: windowed), Megatron's per-layer form
        ([1, 1, 1, 0], [1, 1, 1, 0]),
        ([0, 0, 0, 0], [0, 0, 0, 0]),
    ],
)
def test_gpt_oss_options_are_read(freq, ours):
    """gpt-oss's attention and MLP options as Megatron saves them (the window as a tuple, the skip
    frequency as an int or a per-layer list) map to ours."""
    values, _, _ = model_values(saved(LLAMA, window_attn_skip_freq=freq, **GPT_OSS))
    assert {
        k: values.get(k)
        for k in (
            "window_size",
            "window_attn_skip_freq",
            "softmax_type",
            "quick_geglu",
            "glu_linear_offset",
            "activation_func_clamp_value",
        )
    } == dict(
        window_size="127,0",
        window_attn_skip_freq=ours,
        softmax_type="learnable",
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
    )
    ModelConfig(**values).check()


def test_gpt_oss_options_that_do_not_map_are_named():
    with pytest.raises(MegatronConversionError) as err:
        model_values(saved(LLAMA, **dict(GPT_OSS, window_size=(127, 3), softmax_type="sigmoid")))
    assert "--window-size (127, 3) (a causal window (L, 0)" in str(err.value)
    assert "--softmax-type 'sigmoid'" in str(err.value)
    gelu, _, _ = model_values(saved(GPT, glu_linear_offset=1.0, activation_func_clamp_value=7.0))
    assert "glu_linear_offset" not in gelu and "activation_func_clamp_value" not in gelu  # Megatron ignores them


@pytest.mark.parametrize(
    "overrides,gelu",
    [
        ({}, "tanh"),  # biases + Megatron's default bias-GELU fusion
        ({"bias_gelu_fusion": False}, "none"),  # --no-bias-gelu-fusion: F.gelu
        (
            {"add_bias_linear": False, "add_qkv_bias": False, "bias_gelu_fusion": False},
            "none",
        ),  # as arguments.py saves it
        ({"openai_gelu": True, "bias_gelu_fusion": False}, "none"),  # megatron-core never reads --openai-gelu
    ],
)
def test_gelu_is_megatrons(overrides, gelu):
    """The args Megatron's MLP reads map to the fields that give the same GELU, with no option
    or note: every Megatron GELU is expressible."""
    values, _, notes = model_values(saved(GPT, **overrides))
    assert (ModelConfig(**values).gelu_approximation, notes) == (gelu, [])


def test_bias_gelu_fusion_missing_from_args_is_megatrons_default():
    a = saved(GPT)
    del a.values["bias_gelu_fusion"]
    assert model_values(a)[0]["bias_gelu_fusion"] is True


@pytest.mark.parametrize(
    "saved_vocab,target_tp,want",
    [
        (200, 1, (200, 32, None)),
        (200, 4, (200, 32, None)),  # 200 padded by 16 x TP2 = 224: same rows
        (None, 2, (224, 32, None)),  # vocabulary not saved: the padded rows themselves
        (200, 64, (200, 64, "224 rows to 256")),  # TP 64 needs a divisor of 64: more rows
        (150, 1, (224, 32, None)),  # inconsistent with the rows: keep the rows
    ],
)
def test_vocabulary_keeps_megatrons_rows(saved_vocab, target_tp, want):
    vocab, divisor, note = vocab_values(saved(GPT, vocab_size=saved_vocab), target_tp)
    assert (vocab, divisor) == want[:2]
    assert (note is None) == (want[2] is None) and (want[2] is None or want[2] in note)
    assert -(-vocab // divisor) * divisor == (224 if want[2] is None else 256)


def test_rotary_scaling_comes_along():
    """Megatron's --use-rope-scaling/--rope-scaling-factor and --rotary-seq-len-interpolation-factor."""
    values, _, _ = model_values(
        saved(LLAMA, use_rope_scaling=True, rope_scaling_factor=32.0, rotary_seq_len_interpolation_factor=4)
    )
    assert (
        values["use_rope_scaling"],
        values["rope_scaling_factor"],
        values["rotary_seq_len_interpolation_factor"],
    ) == (True, 32.0, 4)


def test_tiktoken_settings_are_imported():
    """A Megatron TikTokenizer run's pattern and special tokens reach model.yaml (the special tokens
    from --tokenizer-special-tokens, where Megatron copies the deprecated --tiktoken-special-tokens)."""
    from megatron_p2r.convert.megatron.importer import _tokenizer_flags

    vocab = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiktoken", "vocab.json")
    specials = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    saved = SavedArgs(
        {
            "tokenizer_type": "TikTokenizer",
            "tokenizer_model": vocab,
            "tiktoken_pattern": "v1",
            "tiktoken_num_special_tokens": 12,
            "tokenizer_special_tokens": specials,
            "tiktoken_special_tokens": None,
        },
        "args",
    )
    flags, note = _tokenizer_flags(saved)
    assert flags == {
        "tokenizer_type": "TikTokenizer",
        "tokenizer_model": vocab,
        "tiktoken_pattern": "v1",
        "tiktoken_num_special_tokens": 12,
        "tiktoken_special_tokens": specials,
    }
    assert note.endswith("(in model.yaml)")


def _shared_nest(depth=60):
    """A list whose printed form has 2**depth leaves (each level holds the one below twice)."""
    x = []
    for _ in range(depth):
        x = [x, x]
    return x


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (
            "tensor_model_parallel_size",
            "two",
            r"args.tensor_model_parallel_size is 'two' \(str\), expected an integer from "
            "1 to 2147483647",
        ),
        ("tensor_model_parallel_size", [2], r"args.tensor_model_parallel_size is \[2\] \(list\), expected an integer"),
        (
            "tensor_model_parallel_size",
            _shared_nest(),
            r"args.tensor_model_parallel_size is \[\[\[\.\.\.\], \[\.\.\.\]\], \[\[\.\.\.\], \[\.\.\.\]\]\] "
            r"\(list\)",
        ),
        ("num_attention_heads", 0, r"args.num_attention_heads is 0 \(int\), expected an integer from 1"),
        ("num_layers", "4", r"args.num_layers is '4' \(str\), expected an integer from 1 to 65536"),
        ("num_layers", True, r"args.num_layers is True \(bool\)"),
        ("num_layers", 10**9, r"args.num_layers is 1000000000 \(int\), expected an integer from 1 to 65536"),
        ("padded_vocab_size", 10**12, r"args.padded_vocab_size is 1000000000000 \(int\)"),
        ("rotary_base", "1e4", r"args.rotary_base is '1e4' \(str\), expected a finite number"),
        ("hidden_dropout", float("nan"), r"args.hidden_dropout is nan \(float\), expected a finite number"),
        ("normalization", ["RMSNorm"], r"args.normalization is \['RMSNorm'\] \(list\), expected a string"),
        ("window_size", [4], r"args.window_size is \[4\] \(list\), expected a pair of integers"),
        (
            "moe_layer_freq",
            [[1], [1]],
            r"args.moe_layer_freq is \[\[1\], \[1\]\] \(list\), expected an integer >= 1, or "
            "a list of them",
        ),
        ("moe_router_load_balancing_type", _shared_nest(), r"args.moe_router_load_balancing_type is \[\["),
    ],
)
def test_wrongly_typed_args_are_an_error_naming_them(field, value, expected):
    """Issue 38 bug 6: ValueError/TypeError/ZeroDivisionError tracebacks, or num_layers = '4'
    read as if it matched the 4 layers the stages hold."""
    with pytest.raises(CheckpointError, match="^common.pt: " + expected):
        saved(MIXTRAL, **{field: value})


def test_a_huge_padded_vocab_size_costs_no_memory():
    """Issue 38 bug 5: the divisor search listed every multiple of TP up to the row count (38 bytes
    a row: 1.4 GiB for 3e7 rows, a MemoryError for 1e12) before the embedding was checked."""
    args = saved(GPT, padded_vocab_size=3_000_001, vocab_size=7)  # 7 pads to no 3,000,001: the rows' own divisor
    tracemalloc.start()
    try:
        vocab, divisor, _ = vocab_values(args, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (vocab, divisor) == (3_000_001, 1) and peak < 2**20, peak


@pytest.mark.parametrize(
    "capacity",
    [
        dict(moe_expert_capacity_factor=1.25),  # Megatron's default policy: probs
        dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
        dict(moe_expert_capacity_factor=-1.0),  # dropless there (TransformerConfig sets it None)
    ],
)
def test_capacity_is_carried_both_ways(capacity):
    """Megatron's capacity args import as the same field, policy and padding; an export writes
    them back (read back equal, or it is refused) and names them to pass with --use-checkpoint-args."""
    from megatron_p2r.convert.megatron.export_args import MegatronLayout, flags_to_pass
    from megatron_p2r.convert.megatron.export_args import megatron_args as export_args
    from tests.helpers import tiny_config

    moe, _, _ = model_values(saved(MIXTRAL, ep=2, **capacity))
    factor = capacity["moe_expert_capacity_factor"]
    if factor < 0:
        assert "moe_capacity_factor" not in moe
        return
    policy = capacity.get("moe_token_drop_policy", "probs")
    pad = capacity.get("moe_pad_expert_input_to_capacity", False)
    assert (moe["moe_capacity_factor"], moe["moe_token_drop_policy"], moe["moe_pad_expert_input_to_capacity"]) == (
        factor,
        policy,
        pad,
    )
    ours = {k: v for k, v in moe.items() if k.startswith("moe_") or k == "num_experts"}
    cfg = tiny_config(
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True, **ours
    )
    args = export_args(cfg, MegatronLayout(1, 1, 2, "torch_dist"), iteration=1, consumed_samples=0, dtype="float32")
    flags = flags_to_pass(args)
    assert flags[flags.index("--moe-expert-capacity-factor") + 1] == repr(factor)
    assert flags[flags.index("--moe-token-drop-policy") + 1] == policy
    assert ("--moe-pad-expert-input-to-capacity" in flags) == pad


def test_an_unknown_drop_policy_is_named():
    with pytest.raises(MegatronConversionError, match="--moe-token-drop-policy random"):
        model_values(saved(MIXTRAL, moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"))
