"""Gemma 2 and Gemma 3's config.json <-> our options (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

What maps to what: ``hidden_activation`` gelu_pytorch_tanh is --geglu; the four norms a layer
--layer-norms both; the embedding times sqrt(hidden_size) (transformers rounds it to the
weights' dtype) --embedding-multiplier; ``query_pre_attn_scalar`` q is --softmax-scale q**-0.5;
``attn_logit_softcapping`` / ``final_logit_softcapping`` --attn-logit-softcapping /
--final-logit-softcapping; ``sliding_window`` W on the ``layer_types`` sliding layers
--window-size W-1,0 with --window-attn-skip-freq N when every N-th layer is full (Gemma 2:
2, Gemma 3: 6); Gemma 3's per-head ``q_norm`` / ``k_norm`` --qk-layernorm. Rotary: Gemma 2's
``rope_parameters`` as Llama's; Gemma 3's per layer type, the full layers' (default, or "linear"
factor F: --rotary-seq-len-interpolation-factor F) --rotary-base, the sliding layers' (default)
--rotary-base-local, which leaves those layers unscaled (released Gemma 3 4B-27B: full layers
linear 8 over 10^6, sliding layers default over 10^4). The (1 + w) norm weights are converted by
the tensor rules (``rules.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import GEMMA3, HFConversionError
from megatron_p2r.convert.hf.rope import rope_parameters, rope_type

# transformers' names of GELU's tanh formula (ACT2FN)
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# each layer type's older config.json field for its base, and transformers' Gemma3TextConfig.default_theta
_THETA = {"full_attention": ("rope_theta", 1_000_000.0), "sliding_attention": ("rope_local_base_freq", 10_000.0)}


def _layer_types(m: ModelConfig) -> list:
    return ["full_attention" if m.attention_window(i) is None else "sliding_attention" for i in range(m.num_layers)]


def gemma_fields(m: ModelConfig, arch: str, window: Optional[int]) -> dict:
    """Gemma2Config's / Gemma3TextConfig's fields for ``m`` (``window``: transformers'
    sliding_window, None without windows) beyond the ones every architecture writes."""
    scale = m.softmax_scale if m.softmax_scale is not None else m.head_dim**-0.5
    rope = rope_parameters(m)
    if arch == GEMMA3:  # without a local base the sliding layers rotate (and scale) as the full ones
        local = rope if m.rotary_base_local is None else {"rope_type": "default", "rope_theta": m.rotary_base_local}
        rope = {"full_attention": rope, "sliding_attention": dict(local)}
    return {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.query_groups,
        "head_dim": m.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "attention_bias": False,
        "attention_dropout": m.attention_dropout,
        "query_pre_attn_scalar": round(scale**-2),
        # no window: a window no sequence reaches (transformers builds the sliding mask regardless)
        "sliding_window": window if window is not None else m.max_positions,
        "layer_types": _layer_types(m),
        "attn_logit_softcapping": m.attn_logit_softcapping,
        "final_logit_softcapping": m.final_logit_softcapping,
        "use_bidirectional_attention": False,
        "rope_parameters": rope,
    }


def gemma_config(hf: dict, where: str, arch: str) -> dict:
    """``hf`` as the generic rotary reader takes it: transformers' default ``layer_types`` filled in
    (Gemma 2: every 2nd layer full; Gemma 3: every ``sliding_window_pattern``-th, default 6),
    ``hidden_act`` silu standing for the GeGLU read here, and Gemma 3's ``rope_parameters`` of the
    full layers (the sliding layers', under ``sliding_rope_parameters``, are read by ``gemma_values``)."""
    refused = [
        (bool(hf.get("use_bidirectional_attention")), "use_bidirectional_attention true: our attention is causal"),
        (bool(hf.get("attention_bias")), "attention_bias true: Gemma's projections have no bias here"),
        (
            hf.get("hidden_activation", "gelu_pytorch_tanh") not in _TANH_GELU,
            f"hidden_activation {hf.get('hidden_activation')!r}: the gated GELU here is the tanh one ({_TANH_GELU[0]})",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise HFConversionError(f"{where}: {why}")
    layers = hf.get("num_hidden_layers", 1)
    every = hf.get("sliding_window_pattern", 6) if arch == GEMMA3 else 2
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]
    out = {**hf, "hidden_act": "silu", "layer_types": types}
    if arch == GEMMA3:
        rope = gemma3_rope(hf, where)
        out["rope_parameters"], out["sliding_rope_parameters"] = rope["full_attention"], rope["sliding_attention"]
        _check_rope_type(out["rope_parameters"], _rope_field(hf, "full_attention"), where)
    else:
        field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        _check_rope_type(hf.get(field) or {}, field, where)
    return out


def gemma3_rope(hf: dict, where: str) -> dict:
    """Gemma 3's rope_parameters per layer type as transformers' Gemma3TextConfig reads
    config.json: ``rope_parameters`` keyed by layer type, the older fields under them (a flat
    ``rope_scaling`` updates the full layers'; ``rope_theta`` is their base, ``rope_local_base_freq``
    the sliding layers')."""
    given = hf.get("rope_parameters")
    stray = sorted(set(given or {}) - set(_LAYER_TYPES))
    if stray:
        raise HFConversionError(
            f"{where}: rope_parameters has {stray}: Gemma 3's is keyed by layer type ({', '.join(_LAYER_TYPES)})"
        )
    rope = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in _LAYER_TYPES}
    rope["full_attention"].update(hf.get("rope_scaling") or {})
    for kind, (legacy, theta) in _THETA.items():
        rope[kind].setdefault("rope_theta", float(hf.get(legacy, theta)))
        older = rope[kind].pop("type", None)
        rope[kind].setdefault("rope_type", older or "default")
        if older not in (None, rope[kind]["rope_type"]):  # transformers 4 reads ``type``, 5 ``rope_type``
            raise HFConversionError(
                f"{where}: {_rope_field(hf, kind)}.type {older!r} with rope_type {rope[kind]['rope_type']!r}: "
                "transformers 5 rotates this Gemma 3 by rope_type, transformers 4 by type; write one rope_type"
            )
    return rope


def _rope_field(hf: dict, kind: str) -> str:
    """The config.json field a Gemma 3 layer type's rope type came from."""
    if kind == "full_attention" and hf.get("rope_scaling"):
        return "rope_scaling"
    return f"rope_parameters.{kind}"


def _check_rope_type(rope: dict, field: str, where: str) -> None:
    """Gemma's rotary here is default or linear (the llama3 and YaRN types of other families are
    not exported for Gemma, so not imported either)."""
    if rope_type(rope) not in ("default", "linear"):
        raise HFConversionError(
            f"{where}: {field}.rope_type {rope_type(rope)!r}: Gemma's rotary here is default or linear "
            "(--rotary-seq-len-interpolation-factor)"
        )


def gemma_values(hf: dict, where: str, arch: str) -> dict:
    """{ModelConfig field: value} of Gemma beyond the generic rotary reader's (``hf`` as
    ``gemma_config`` returned it)."""
    h = hf["hidden_size"]
    dtype = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    values = dict(
        swiglu=False,
        geglu=True,
        layer_norms="both",
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        embedding_multiplier=float(torch.tensor(h**0.5, dtype=dtype)),
        softmax_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        disable_bias_linear=True,
    )
    if arch == GEMMA3:
        values["qk_layernorm"] = True
        values.update(_local_rope_values(hf, where))
    return values


def _local_rope_values(hf: dict, where: str) -> dict:
    """--rotary-base-local for Gemma 3's sliding layers: their own default rotary, unless it is the
    full layers' rotary (then every layer rotates alike, without it)."""
    full, local = hf["rope_parameters"], hf["sliding_rope_parameters"]
    windowed = hf.get("sliding_window") is not None and "sliding_attention" in hf["layer_types"]
    if not windowed or local == full:
        return {}
    if local["rope_type"] != "default":
        raise HFConversionError(
            f"{where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} with full layers' "
            f"{full['rope_type']!r}: the sliding layers' rotary here is the full layers' or unscaled "
            "(--rotary-base-local)"
        )
    return {"rotary_base_local": float(local["rope_theta"])}
