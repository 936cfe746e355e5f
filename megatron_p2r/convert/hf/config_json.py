"""config.json: written for an exported model of ours, read back into our model options on import
(every HF option without an equivalent here is an error naming the field)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from megatron_p2r.convert.hf.architecture import (
    DEEPSEEK_V3,
    EVERY_LAYER_WINDOWED,
    GEMMAS,
    GPT2,
    GPT_OSS,
    GRANITE,
    GRANITE_MOE,
    GRANITES,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    MODEL_TYPES,
    OLMO2,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    REFUSED,
    HFConversionError,
)
from megatron_p2r.convert.hf.config_schema import check_hf_config, required_field
from megatron_p2r.convert.hf.deepseek_v3 import latent_fields, latent_values
from megatron_p2r.convert.hf.gemma import gemma_config, gemma_fields, gemma_values
from megatron_p2r.convert.hf.gpt_oss import gpt_oss_fields, gpt_oss_values
from megatron_p2r.convert.hf.rope import rope_parameters, rope_scaling_values
from megatron_p2r.config import ModelConfig

# GPT2's activation_function: transformers' names for GELU's tanh formula and for exact (erf) GELU,
# as ModelConfig.gelu_approximation. Export writes gelu_new (GPT-2's own) or gelu.
_GPT2_GELU = {
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_fast": "tanh",
    "gelu_accurate": "tanh",
    "gelu_python_tanh": "tanh",
    "gelu": "none",
    "gelu_python": "none",
}


def hf_config(m: ModelConfig, arch: str, hf_vocab: int, dtype: str, special: Dict[str, Optional[int]]) -> dict:
    """config.json for ``m`` (a plain dict: writing it needs no transformers)."""
    common = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": hf_vocab,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "initializer_range": m.init_method_std,
        "use_cache": True,
        "dtype": dtype,
        "bos_token_id": special.get("bos"),
        "eos_token_id": special.get("eos"),
        "pad_token_id": special.get("pad"),
    }
    if arch == GPT2:
        return {**common, **_gpt2_fields(m)}
    if arch == DEEPSEEK_V3:
        return {**common, **latent_fields(m)}
    if arch in GEMMAS:
        return {**common, **gemma_fields(m, arch, _hf_window(m))}
    cfg = {
        **common,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.query_groups,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "attention_dropout": m.attention_dropout,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta
        "rope_parameters": rope_parameters(m),
        "rope_theta": m.rotary_base,
    }
    if m.use_rope_scaling or m.rotary_seq_len_interpolation_factor is not None or m.yarn:
        cfg["rope_scaling"] = cfg["rope_parameters"]  # transformers 4.x's name
    if arch in GRANITES:
        cfg.update(_granite_fields(m))
    if arch in (LLAMA, GRANITE):
        return {
            **cfg,
            "intermediate_size": m.ffn_size,
            "attention_bias": m.add_bias,
            "mlp_bias": m.add_bias,
            "pretraining_tp": 1,
        }
    if arch == OLMO2:
        return {**cfg, "intermediate_size": m.ffn_size, "attention_bias": False}
    window = _hf_window(m)
    if arch == GPT_OSS:
        return {**cfg, **gpt_oss_fields(m, window)}
    if arch == MISTRAL:
        return {**cfg, "intermediate_size": m.ffn_size, "sliding_window": window}
    if arch in (QWEN2, QWEN3):
        types = [
            "full_attention" if m.attention_window(i) is None else "sliding_attention" for i in range(m.num_layers)
        ]
        return {
            **cfg,
            "intermediate_size": m.ffn_size,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": m.num_layers if window is None else 0,
            "layer_types": types,
            **({"attention_bias": False} if arch == QWEN3 else {}),
        }
    return {**cfg, **_moe_fields(m, arch), "sliding_window": window}


def _granite_fields(m: ModelConfig) -> dict:
    """Granite's multipliers (attention_multiplier: the softmax scale, always given)."""
    return {
        "embedding_multiplier": m.embedding_multiplier,
        "residual_multiplier": m.residual_multiplier,
        "attention_multiplier": m.softmax_scale if m.softmax_scale is not None else m.head_dim**-0.5,
        "logits_scaling": m.logits_scaling,
    }


def _moe_fields(m: ModelConfig, arch: str) -> dict:
    """Mixtral's, Qwen3-MoE's and Granite-MoE's expert fields."""
    if arch == QWEN3_MOE:
        return {
            "intermediate_size": m.ffn_size,
            "moe_intermediate_size": m.expert_ffn_size,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            "norm_topk_prob": not m.moe_router_pre_softmax,
            "decoder_sparse_step": 1,  # every layer MoE but the dense ones listed
            "mlp_only_layers": [layer for layer in range(m.num_layers) if not m.is_moe_layer(layer)],
            "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "output_router_logits": False,
            "attention_bias": False,
            "use_sliding_window": m.window_size is not None,
        }
    mixtral = {
        "intermediate_size": m.expert_ffn_size,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
    if arch == GRANITE_MOE:
        return {**mixtral, "attention_bias": False}
    return {**mixtral, "router_jitter_noise": m.moe_input_jitter_eps or 0.0}


def _gpt2_fields(m: ModelConfig) -> dict:
    """GPT2Config's own names for ``m``'s shape, activation, norm and dropouts."""
    return {
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn_size,
        "n_positions": m.max_positions,
        "activation_function": "gelu_new" if m.gelu_approximation == "tanh" else "gelu",
        "layer_norm_epsilon": m.norm_epsilon,
        "resid_pdrop": m.hidden_dropout,
        "embd_pdrop": m.hidden_dropout,
        "attn_pdrop": m.attention_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _hf_window(m: ModelConfig) -> Optional[int]:
    """transformers' sliding_window (tokens a query sees, itself included) for --window-size L,0."""
    windows = {m.attention_window(i) for i in range(m.num_layers)} - {None}
    return windows.pop() + 1 if windows else None


def model_values_from_hf(hf: dict, where: str) -> Tuple[str, dict]:
    """(architecture, {ModelConfig field: value}) for an HF config.json, or an error naming the field."""
    check_hf_config(hf, where)
    model_type = hf.get("model_type")
    arch = {v: k for k, v in MODEL_TYPES.items()}.get(model_type)
    if model_type in REFUSED:
        raise HFConversionError(f"{where}: model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    if arch is None:
        raise HFConversionError(
            f"{where}: model_type {model_type!r} is not supported; import reads {sorted(MODEL_TYPES.values())}"
        )
    if arch == GPT2:
        return arch, _gpt2_values(hf, where)
    if arch == DEEPSEEK_V3:
        return arch, latent_values(hf, where)
    if arch in GEMMAS:
        hf = gemma_config(hf, where, arch)
        return arch, {**_rotary_values(hf, where, arch), **gemma_values(hf, where, arch)}
    return arch, _rotary_values(hf, where, arch)


def _gpt2_values(hf: dict, where: str) -> dict:
    """GPT2 always has biases, so its GELU is tanh exactly when --bias-gelu-fusion (Megatron's rule)."""
    tied = bool(hf.get("tie_word_embeddings", True))
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_GELU:
        raise HFConversionError(
            f"{where}: activation_function {act!r} has no equivalent here (GELU: one of {sorted(_GPT2_GELU)})"
        )
    for key, want in [
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
        ("add_cross_attention", False),
    ]:
        if hf.get(key, want) != want:
            raise HFConversionError(f"{where}: {key} = {hf[key]!r} has no equivalent here (need {want})")
    h = required_field(hf, "n_embd", where)
    return dict(
        num_layers=required_field(hf, "n_layer", where),
        hidden_size=h,
        num_attention_heads=required_field(hf, "n_head", where),
        ffn_hidden_size=hf.get("n_inner") or 4 * h,
        max_position_embeddings=required_field(hf, "n_positions", where),
        normalization="LayerNorm",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        swiglu=False,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not tied,
        disable_bias_linear=False,
        bias_gelu_fusion=_GPT2_GELU[act] == "tanh",
        hidden_dropout=hf.get("resid_pdrop", 0.0),
        attention_dropout=hf.get("attn_pdrop", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def sliding_window(hf: dict) -> Optional[int]:
    """The attention window of a Mistral, Mixtral or Qwen config.json (tokens a query sees,
    itself included), or None (full causal)."""
    if hf.get("model_type") in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window")


def _windowed_layers(hf: dict, where: str, layers: int) -> List[bool]:
    """Which layers transformers gives the window: Qwen2 and Qwen3 those of ``layer_types``
    (default: from layer max_window_layers on), Mistral, Mixtral and Qwen3-MoE every layer."""
    if hf.get("model_type") in (MODEL_TYPES[a] for a in EVERY_LAYER_WINDOWED):
        return [True] * layers
    kinds = ("sliding_attention", "full_attention")
    types = hf.get("layer_types") or [kinds[i < hf.get("max_window_layers", 28)] for i in range(layers)]
    if len(types) != layers or any(t not in kinds for t in types):
        raise HFConversionError(f"{where}: layer_types must be {layers} entries of {list(kinds)}, got {types}")
    return [t == "sliding_attention" for t in types]


def _window_values(hf: dict, where: str, layers: int) -> dict:
    """--window-size W-1,0 for transformers' sliding_window W, and --window-attn-skip-freq N when
    layers N-1, 2N-1, ... are the full ones, or the per-layer list (1: windowed) otherwise."""
    window = sliding_window(hf)
    windowed = _windowed_layers(hf, where, layers) if window is not None else []
    if not any(windowed):
        return {}
    values = {"window_size": f"{window - 1},0"}
    if all(windowed):
        return values
    for n in range(2, layers + 1):
        if windowed == [(i + 1) % n != 0 for i in range(layers)]:
            return {**values, "window_attn_skip_freq": n}
    return {**values, "window_attn_skip_freq": [int(w) for w in windowed]}


def _attention_values(hf: dict, where: str, h: int, heads: int) -> dict:
    """Heads, key/value groups, head dimension and rotary of a rotary config.json."""
    kv = hf.get("num_key_value_heads") or heads
    if heads % kv:
        raise HFConversionError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    values = dict(num_attention_heads=heads)
    if kv != heads:
        values.update(group_query_attention=True, num_query_groups=kv)
    if hf.get("head_dim") not in (None, h // heads) or h % heads:
        values["kv_channels"] = required_field(hf, "head_dim", where)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    values.update(rope_scaling_values(rope, where, hf.get("max_position_embeddings", 4096)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFConversionError(
            f"{where}: partial_rotary_factor {partial}: {hf.get('model_type')} in transformers "
            "rotates whole heads, so such a config does not run there"
        )
    values["rotary_base"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    return values


def _bias_values(hf: dict, where: str, arch: str) -> dict:
    """--disable-bias-linear / --add-qkv-bias: Llama's attention_bias and mlp_bias, Qwen2's
    query/key/value biases (Granite: Llama's); Mistral, Mixtral, Qwen3 and Granite-MoE have none (their attention_bias would
    bias the output projection too but not the MLP, which no flag here expresses)."""
    if arch == QWEN2:
        return dict(disable_bias_linear=True, add_qkv_bias=True)
    if arch in (QWEN3, QWEN3_MOE, GRANITE_MOE, OLMO2) and hf.get("attention_bias", False):
        raise HFConversionError(
            f"{where}: attention_bias true (query/key/value and output biases without MLP biases) "
            "has no equivalent here"
        )
    if arch not in (LLAMA, GRANITE):
        return dict(disable_bias_linear=True)
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise HFConversionError(
            f"{where}: attention_bias {bias} with mlp_bias {hf.get('mlp_bias')}; "
            "--disable-bias-linear removes both or neither"
        )
    return dict(disable_bias_linear=not bias)


def _rotary_values(hf: dict, where: str, arch: str) -> dict:
    """Llama, Mistral, Qwen2 and Mixtral: rotary, RMSNorm, SwiGLU (Mixtral: in top-k experts),
    grouped-query attention when there are fewer key/value heads than query heads.

    A sliding window of W tokens (the query itself included) is --window-size W-1,0."""
    tied = bool(hf.get("tie_word_embeddings", True))
    h, heads = required_field(hf, "hidden_size", where), required_field(hf, "num_attention_heads", where)
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"{where}: hidden_act {hf['hidden_act']!r}; only SwiGLU (silu) is supported")
    max_pos = hf.get("max_position_embeddings", 4096)
    layers = required_field(hf, "num_hidden_layers", where)
    values = dict(
        num_layers=layers,
        hidden_size=h,
        ffn_hidden_size=required_field(hf, "intermediate_size", where),
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        position_embedding_type="rope",
        max_position_embeddings=max_pos,
        untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
    )
    values.update(
        _attention_values(hf, where, h, heads), **_bias_values(hf, where, arch), **_window_values(hf, where, layers)
    )
    if arch in (QWEN3, QWEN3_MOE):
        values["qk_layernorm"] = True
    if arch == OLMO2:  # norms on the outputs; query/key norms over all heads
        values.update(layer_norms="output", qk_layernorm=True, qk_layernorm_over_heads=True)
    if arch == QWEN3_MOE:
        values.update(_qwen3_moe_values(hf, where, layers))
    if arch == GPT_OSS:
        values.update(gpt_oss_values(hf, where))
    if arch in GRANITES:
        values.update(
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            softmax_scale=float(hf.get("attention_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
        )
    if arch in (MIXTRAL, GRANITE_MOE):
        values.update(
            num_experts=required_field(hf, "num_local_experts", where),
            moe_router_topk=required_field(hf, "num_experts_per_tok", where),
            moe_layer_freq=1,
            moe_ffn_hidden_size=values["ffn_hidden_size"],
            moe_router_pre_softmax=False,
            moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
            moe_input_jitter_eps=hf.get("router_jitter_noise") or None,
        )
    return values


def _qwen3_moe_values(hf: dict, where: str, layers: int) -> dict:
    """Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob (our default)
    or kept as probabilities (--moe-router-pre-softmax); layer i is MoE when (i + 1) is a multiple of
    decoder_sparse_step and i is not in mlp_only_layers (--moe-layer-freq as a list unless every
    layer is), the dense layers of intermediate_size."""
    step = hf.get("decoder_sparse_step", 1)
    dense_only = set(hf.get("mlp_only_layers") or [])
    pattern = [int((i + 1) % step == 0 and i not in dense_only) for i in range(layers)]
    return dict(
        # the hub's files say num_experts; transformers 5 writes num_local_experts
        num_experts=hf.get("num_experts") or required_field(hf, "num_local_experts", where),
        moe_router_topk=required_field(hf, "num_experts_per_tok", where),
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_ffn_hidden_size=required_field(hf, "moe_intermediate_size", where),
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
    )


def import_vocab_divisor(
    rows: int, tp: int, requested: Optional[int] = None, tokens: Optional[int] = None
) -> Optional[int]:
    """``--make-vocab-size-divisible-by`` for an imported embedding of ``rows`` rows: the largest
    power of two (<= 128) that divides it and is a multiple of TP, so nothing is padded; else
    128 (or TP). With ``tokens`` (a tokenizer's vocabulary, from which training takes
    --vocab-size) the divisor must pad ``tokens`` to exactly ``rows``: the first such multiple of
    TP (powers of two first), or None when there is none."""
    if requested is not None:
        if requested < 1 or requested % tp:
            raise HFConversionError(
                f"--make-vocab-size-divisible-by {requested} must be >= 1 and divisible by the target TP ({tp})"
            )
        return requested if tokens is None or -(-tokens // requested) * requested == rows else None
    if tokens is None:
        tokens = rows
        fallback: Optional[int] = 128 if 128 % tp == 0 else tp
    else:
        fallback = None
    powers = (128, 64, 32, 16, 8, 4, 2, 1)
    for d in (*powers, *_multiples_dividing(rows, tp)):
        if d % tp == 0 and rows % d == 0 and rows - d < tokens <= rows:
            return d
    return fallback


def _multiples_dividing(rows: int, tp: int) -> List[int]:
    """The multiples of ``tp`` that divide ``rows``, ascending: ``tp`` times each divisor of
    ``rows / tp``, found in sqrt(rows / tp) steps (the list of every multiple of ``tp`` up to
    ``rows`` took 38 bytes a row: 1.4 GiB for a row count of 3e7)."""
    if rows < 1 or rows % tp:
        return []
    m = rows // tp
    small = [k for k in range(1, math.isqrt(m) + 1) if m % k == 0]
    return [tp * k for k in small + [m // k for k in reversed(small) if k * k != m]]
