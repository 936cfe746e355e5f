"""Gemma 2 and Gemma 3's config.json <-> our options (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

What maps to what: ``hidden_activation`` gelu_pytorch_tanh is --geglu; the four norms a layer
--layer-norms both; the embedding times sqrt(hidden_size) (transformers rounds it to the
weights' dtype) --embedding-multiplier; ``query_pre_attn_scalar`` q is --softmax-scale q**-0.5;
``attn_logit_softcapping`` / ``final_logit_softcapping`` --attn-logit-softcapping /
--final-logit-softcapping; ``sliding_window`` W on the ``layer_types`` sliding layers
--window-size W-1,0 with --window-attn-skip-freq N when every N-th layer is full (Gemma 2:
2, Gemma 3: 6); Gemma 3's per-head ``q_norm`` / ``k_norm`` --qk-layernorm and its
``rope_parameters`` per layer type --rotary-base (full layers) and --rotary-base-local (sliding
layers). The (1 + w) norm weights are converted by the tensor rules (``rules.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import GEMMA3, HFConversionError

# transformers' names of GELU's tanh formula (ACT2FN)
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _layer_types(m: ModelConfig) -> list:
    return ["full_attention" if m.attention_window(i) is None else "sliding_attention" for i in range(m.num_layers)]


def gemma_fields(m: ModelConfig, arch: str, window: Optional[int]) -> dict:
    """Gemma2Config's / Gemma3TextConfig's fields for ``m`` (``window``: transformers'
    sliding_window, None without windows) beyond the ones every architecture writes."""
    scale = m.softmax_scale if m.softmax_scale is not None else m.head_dim**-0.5
    full = {"rope_type": "default", "rope_theta": m.rotary_base}
    if arch == GEMMA3:
        local = m.rotary_base_local if m.rotary_base_local is not None else m.rotary_base
        rope = {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    else:
        rope = full
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
    full layers (the sliding layers' are read by ``gemma_values``)."""
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
        out["rope_parameters"] = _rope_of(hf, "full_attention", where, 1_000_000.0)
    return out


def _rope_of(hf: dict, kind: str, where: str, theta: float) -> dict:
    """Gemma 3's rope_parameters of one layer type; only the default rotary (no scaling) is read."""
    rope = (hf.get("rope_parameters") or {}).get(kind) or {"rope_type": "default"}
    if rope.get("rope_type", "default") != "default":
        raise HFConversionError(
            f"{where}: rope_parameters.{kind}.rope_type {rope['rope_type']!r}: Gemma 3's rotary scaling per "
            "layer type is not built here (only the default rotary, a base per layer type)"
        )
    legacy = hf.get("rope_theta" if kind == "full_attention" else "rope_local_base_freq", theta)
    return {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", legacy))}


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
        local = _rope_of(hf, "sliding_attention", where, 10_000.0)["rope_theta"]
        windowed = hf.get("sliding_window") is not None and "sliding_attention" in hf["layer_types"]
        if windowed and local != hf["rope_parameters"]["rope_theta"]:
            values["rotary_base_local"] = local
    return values
