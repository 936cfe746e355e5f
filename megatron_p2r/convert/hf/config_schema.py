"""The schema of an HF config.json as import reads it: the type and range of every field
``config_json.model_values_from_hf`` uses, so a hand-edited or crafted file fails naming the
field (``n_embd: expected an integer in [1, 262144], got "abc"``) instead of deep inside the
conversion or in a runaway allocation. Absent fields and nulls take transformers' defaults."""

from __future__ import annotations

import math
from typing import Dict, Tuple

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.config.ranges import LAYERS, Range, at_least, fraction, positive

_INT, _FLOAT, _BOOL, _STR, _DICT, _LIST = "an integer", "a number", "true or false", "a string", "an object", "a list"
_SIZE = at_least(1, 2**20)
_ROTARY_FRACTION = Range(0.0, 1.0, low_open=True)

# field -> (kind, range or None); every field is optional here (``required_field`` asks for the needed ones).
HF_FIELDS: Dict[str, Tuple[str, object]] = {
    "model_type": (_STR, None),
    "architectures": (_LIST, None),
    "vocab_size": (_INT, at_least(2, 2**31 - 1)),
    "tie_word_embeddings": (_BOOL, None),
    "initializer_range": (_FLOAT, positive()),
    # GPT2
    "n_embd": (_INT, at_least(1, 2**18)),
    "n_layer": (_INT, at_least(1, LAYERS)),
    "n_head": (_INT, at_least(1, LAYERS)),
    "n_inner": (_INT, _SIZE),
    "n_positions": (_INT, at_least(1, 2**24)),
    "activation_function": (_STR, None),
    "layer_norm_epsilon": (_FLOAT, positive(1.0)),
    "resid_pdrop": (_FLOAT, fraction()),
    "embd_pdrop": (_FLOAT, fraction()),
    "attn_pdrop": (_FLOAT, fraction()),
    "scale_attn_by_inverse_layer_idx": (_BOOL, None),
    "reorder_and_upcast_attn": (_BOOL, None),
    "scale_attn_weights": (_BOOL, None),
    "add_cross_attention": (_BOOL, None),
    # Llama / Mixtral
    "hidden_size": (_INT, at_least(1, 2**18)),
    "num_hidden_layers": (_INT, at_least(1, LAYERS)),
    "num_attention_heads": (_INT, at_least(1, LAYERS)),
    "num_key_value_heads": (_INT, at_least(1, LAYERS)),
    "head_dim": (_INT, at_least(1, 2**18)),
    "intermediate_size": (_INT, _SIZE),
    "hidden_act": (_STR, None),
    "max_position_embeddings": (_INT, at_least(1, 2**24)),
    "rms_norm_eps": (_FLOAT, positive(1.0)),
    "attention_dropout": (_FLOAT, fraction()),
    "rope_theta": (_FLOAT, positive()),
    "rope_parameters": (_DICT, None),
    "rope_scaling": (_DICT, None),
    "attention_bias": (_BOOL, None),
    "mlp_bias": (_BOOL, None),
    "num_local_experts": (_INT, at_least(1, 2**16)),
    "num_experts_per_tok": (_INT, at_least(1, 2**16)),
    "router_aux_loss_coef": (_FLOAT, Range(0.0)),
    "router_jitter_noise": (_FLOAT, fraction()),
    "partial_rotary_factor": (_FLOAT, _ROTARY_FRACTION),
    # Qwen3-MoE
    "num_experts": (_INT, at_least(1, 2**16)),
    "moe_intermediate_size": (_INT, _SIZE),
    "decoder_sparse_step": (_INT, at_least(1, LAYERS)),
    "mlp_only_layers": (_LIST, None),
    "norm_topk_prob": (_BOOL, None),
    # Granite
    "embedding_multiplier": (_FLOAT, positive()),
    "residual_multiplier": (_FLOAT, positive()),
    "attention_multiplier": (_FLOAT, positive()),
    "logits_scaling": (_FLOAT, positive()),
    # Mistral / Mixtral / Qwen2 sliding-window attention
    "sliding_window": (_INT, at_least(1, 2**24)),
    "use_sliding_window": (_BOOL, None),
    "layer_types": (_LIST, None),
    "max_window_layers": (_INT, at_least(0, 2**24)),
    # DeepSeek-V3's multi-latent attention and dense-layer count
    "q_lora_rank": (_INT, at_least(1, 2**18)),
    "kv_lora_rank": (_INT, at_least(1, 2**18)),
    "qk_nope_head_dim": (_INT, at_least(1, 2**16)),
    "qk_rope_head_dim": (_INT, at_least(2, 2**16)),
    "v_head_dim": (_INT, at_least(1, 2**16)),
    "first_k_dense_replace": (_INT, at_least(0, LAYERS)),
    "rope_interleave": (_BOOL, None),
    # DeepSeek-V3's MoE and multi-token prediction
    "n_routed_experts": (_INT, at_least(1, 2**16)),
    "n_shared_experts": (_INT, at_least(0, 2**16)),
    "routed_scaling_factor": (_FLOAT, positive()),
    "n_group": (_INT, at_least(1, 2**16)),
    "topk_group": (_INT, at_least(1, 2**16)),
    "scoring_func": (_STR, None),
    "topk_method": (_STR, None),
    "num_nextn_predict_layers": (_INT, at_least(0, LAYERS)),
    # Gemma 2 / 3
    "hidden_activation": (_STR, None),
    "query_pre_attn_scalar": (_FLOAT, positive()),
    "attn_logit_softcapping": (_FLOAT, positive()),
    "final_logit_softcapping": (_FLOAT, positive()),
    "use_bidirectional_attention": (_BOOL, None),
    "sliding_window_pattern": (_INT, at_least(1, LAYERS)),
    "rope_local_base_freq": (_FLOAT, positive()),
    # gpt-oss's clamped quick-GeGLU
    "swiglu_alpha": (_FLOAT, positive()),
    "swiglu_limit": (_FLOAT, positive()),
}
_ROPE_FIELDS = {
    "rope_type": (_STR, None),
    "type": (_STR, None),
    "rope_theta": (_FLOAT, positive()),
    "partial_rotary_factor": (_FLOAT, _ROTARY_FRACTION),
    "factor": (_FLOAT, positive()),
    "mscale": (_FLOAT, Range(0.0, 1e6)),
    "mscale_all_dim": (_FLOAT, Range(0.0, 1e6)),
    "original_max_position_embeddings": (_INT, at_least(1, 2**24)),
    "beta_fast": (_FLOAT, positive()),
    "beta_slow": (_FLOAT, positive()),
    "truncate": (_BOOL, None),
    "attention_factor": (_FLOAT, positive()),
}


def _matches(kind: str, value) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {_STR: str, _DICT: dict, _LIST: list}[kind])


def _check(fields: Dict[str, Tuple[str, object]], values: dict, where: str, prefix: str = "") -> None:
    for name, (kind, limits) in fields.items():
        value = values.get(name)
        if value is None:
            continue
        if not _matches(kind, value) or (limits is not None and not limits.contains(value)):
            expected = kind + (f" in {limits.describe()}" if limits is not None else "")
            raise HFConversionError(f"{where}: {prefix}{name} must be {expected}, got {str(value)[:60]!r}")


def check_hf_config(hf, where: str) -> None:
    """Raise HFConversionError naming the first field of config.json that is not what import reads."""
    if not isinstance(hf, dict):
        raise HFConversionError(f"{where}: expected a JSON object, found {type(hf).__name__}")
    _check(HF_FIELDS, hf, where)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(key), dict):
            _check(_ROPE_FIELDS, hf[key], where, f"{key}.")
            for kind in ("full_attention", "sliding_attention"):  # Gemma 3: one per layer type
                if isinstance(hf[key].get(kind), dict):
                    _check(_ROPE_FIELDS, hf[key][kind], where, f"{key}.{kind}.")


def required_field(hf: dict, key: str, where: str):
    """``hf[key]``, or an error naming the field of ``where`` (a config.json path)."""
    if key in hf and hf[key] is not None:
        return hf[key]
    raise HFConversionError(f"{where}: required field {key!r} is missing")
