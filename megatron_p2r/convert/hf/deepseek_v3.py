"""DeepSeek-V3's config.json <-> our multi-latent attention options (``DeepseekV3ForCausalLM``).

transformers' names: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim`` (our --qk-head-dim),
``qk_rope_head_dim`` (--qk-pos-emb-head-dim), ``v_head_dim``; ``rope_parameters`` of type
``yarn`` carry --rotary-scaling-factor (``factor``), --mscale and --mscale-all-dim. YaRN's
original context and betas are megatron-core's fixed MLA values (``YARN_ORIGINAL_CONTEXT``...):
other values are refused by name. Only dense layers are read (``first_k_dense_replace`` >= the
layer count): DeepSeek's routed and shared experts are built elsewhere.
"""

from __future__ import annotations

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.config_schema import required_field
from megatron_p2r.config import ModelConfig
from megatron_p2r.model.latent_attention import YARN_BETA_FAST, YARN_BETA_SLOW, YARN_ORIGINAL_CONTEXT

_YARN_FIXED = {
    "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT,
    "beta_fast": YARN_BETA_FAST,
    "beta_slow": YARN_BETA_SLOW,
}


def latent_fields(m: ModelConfig) -> dict:
    """DeepseekV3Config's fields for ``m`` (beyond the ones every architecture writes)."""
    return {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "first_k_dense_replace": m.num_layers,  # every layer dense
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_head_dim,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "attention_bias": False,
        "attention_dropout": m.attention_dropout,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": m.rotary_base,
            "factor": m.rotary_scaling_factor,
            "mscale": m.mscale,
            "mscale_all_dim": m.mscale_all_dim,
            **_YARN_FIXED,
        },
    }


def latent_values(hf: dict, where: str) -> dict:
    """{ModelConfig field: value} for a DeepSeek-V3 config.json, or an error naming the field."""
    layers = required_field(hf, "num_hidden_layers", where)
    heads = required_field(hf, "num_attention_heads", where)
    dense = hf.get("first_k_dense_replace", 3)
    refused = [
        (
            dense < layers,
            f"first_k_dense_replace {dense} < num_hidden_layers {layers}: DeepSeek's MoE layers "
            "(routed and shared experts) are not imported yet",
        ),
        (hf.get("num_key_value_heads", heads) != heads, "num_key_value_heads must equal num_attention_heads"),
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}: only SwiGLU (silu)"),
        (bool(hf.get("attention_bias", False)), "attention_bias true: our latent projections have no bias"),
        (not hf.get("rope_interleave", True), "rope_interleave false: megatron-core's MLA rotates interleaved pairs"),
    ]
    for bad, why in refused:
        if bad:
            raise HFConversionError(f"{where}: {why}")
    max_pos = hf.get("max_position_embeddings", 4096)
    return dict(
        num_layers=layers,
        hidden_size=required_field(hf, "hidden_size", where),
        ffn_hidden_size=required_field(hf, "intermediate_size", where),
        num_attention_heads=heads,
        multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=required_field(hf, "kv_lora_rank", where),
        qk_head_dim=required_field(hf, "qk_nope_head_dim", where),
        qk_pos_emb_head_dim=required_field(hf, "qk_rope_head_dim", where),
        v_head_dim=required_field(hf, "v_head_dim", where),
        qk_layernorm=True,
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        disable_bias_linear=True,
        position_embedding_type="rope",
        max_position_embeddings=max_pos,
        untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        **_yarn_values(hf.get("rope_parameters") or hf.get("rope_scaling") or {}, where),
    )


def _yarn_values(rope: dict, where: str) -> dict:
    """--rotary-base, --rotary-scaling-factor, --mscale, --mscale-all-dim of ``rope_parameters``."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = dict(rotary_base=float(rope.get("rope_theta", 10000.0)))
    if kind == "default":
        return base
    if kind != "yarn":
        raise HFConversionError(f"{where}: rope_parameters.rope_type {kind!r}: DeepSeek-V3 takes yarn or default")
    for key, want in _YARN_FIXED.items():
        if key in rope and float(rope[key]) != want:
            raise HFConversionError(
                f"{where}: rope_parameters.{key} {rope[key]}: megatron-core's multi-latent attention fixes it at {want}"
            )
    if "factor" not in rope:
        raise HFConversionError(f"{where}: rope_parameters.factor is missing (YaRN's --rotary-scaling-factor)")
    if not rope.get("truncate", True) or rope.get("attention_factor") is not None:
        raise HFConversionError(
            f"{where}: rope_parameters truncate / attention_factor: megatron-core's YaRN rounds the correction "
            "range and derives the attention factor from mscale and mscale_all_dim"
        )
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # Without both, transformers scales the tables by mscale(factor, 1), whatever the one given says.
    if mscale_all_dim and not mscale:
        raise HFConversionError(f"{where}: rope_parameters.mscale_all_dim {mscale_all_dim} without mscale")
    if mscale and not mscale_all_dim and mscale != 1.0:
        raise HFConversionError(f"{where}: rope_parameters.mscale {mscale} without mscale_all_dim")
    return dict(
        base,
        rotary_scaling_factor=float(rope["factor"]),
        mscale=float(mscale or 1.0),
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )
