"""DeepSeek-V3's config.json <-> our multi-latent attention, MoE and multi-token prediction
options (``DeepseekV3ForCausalLM``).

transformers' names: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim`` (our --qk-head-dim),
``qk_rope_head_dim`` (--qk-pos-emb-head-dim), ``v_head_dim``; ``rope_parameters`` of type
``yarn`` carry --rotary-scaling-factor (``factor``), --mscale and --mscale-all-dim. YaRN's
original context and betas are megatron-core's fixed MLA values (``YARN_ORIGINAL_CONTEXT``...):
other values are refused by name.

MoE (``convert/hf/architecture.py`` lists what cannot be exported): transformers' router is
Megatron's sigmoid router with the expert bias (``e_score_correction_bias``, always added to
choose) and ``--moe-router-topk-scaling-factor`` (``routed_scaling_factor``); its group statistic
is the sum of a group's top-2 scores where Megatron's is the top-(topk/group-topk), so groups are
read only where the two agree; it normalises the k weights when ``norm_topk_prob``, Megatron for
every k > 1, so only norm_topk_prob == (k > 1) is read. The first ``first_k_dense_replace`` layers
are dense. Multi-token prediction is not in transformers' model: DeepSeek's files hold depth d as
decoder layer ``num_hidden_layers + d`` (``num_nextn_predict_layers``), which transformers skips.
"""

from __future__ import annotations

from typing import Iterable

from megatron_p2r.convert.hf.architecture import LATENT_NORM_EPSILON, HFConversionError, dense_first_layers
from megatron_p2r.convert.hf.config_schema import required_field
from megatron_p2r.convert.hf.rope import rope_type
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
        **_moe_fields(m),
    }


def _moe_fields(m: ModelConfig) -> dict:
    """The routing fields, first_k_dense_replace and num_nextn_predict_layers (a dense model's MTP
    layers are dense too: their indices, num_hidden_layers + d, stay below first_k_dense_replace)."""
    mtp = m.mtp_num_layers or 0
    if not m.num_experts:
        return {"first_k_dense_replace": m.num_layers + mtp, "num_nextn_predict_layers": mtp}
    limited = m.moe_router_group_topk is not None
    return {
        "first_k_dense_replace": dense_first_layers(m),
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.expert_ffn_size,
        "n_shared_experts": m.shared_expert_ffn_size // m.expert_ffn_size,
        "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
        "n_group": m.moe_router_num_groups if limited else 1,
        "topk_group": m.moe_router_group_topk if limited else 1,
        "norm_topk_prob": m.moe_router_topk > 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": mtp,
    }


def latent_values(hf: dict, where: str) -> dict:
    """{ModelConfig field: value} for a DeepSeek-V3 config.json, or an error naming the field."""
    layers = required_field(hf, "num_hidden_layers", where)
    heads = required_field(hf, "num_attention_heads", where)
    refused = [
        (hf.get("num_key_value_heads", heads) != heads, "num_key_value_heads must equal num_attention_heads"),
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}: only SwiGLU (silu)"),
        (bool(hf.get("attention_bias", False)), "attention_bias true: our latent projections have no bias"),
        (not hf.get("rope_interleave", True), "rope_interleave false: megatron-core's MLA rotates interleaved pairs"),
        (
            hf.get("rms_norm_eps", 1e-6) != LATENT_NORM_EPSILON,
            f"rms_norm_eps {hf.get('rms_norm_eps')}: transformers normalises the latents with eps "
            f"{LATENT_NORM_EPSILON} whatever it says, our --norm-epsilon every norm",
        ),
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
        **_moe_values(hf, where, layers),
    )


def _moe_values(hf: dict, where: str, layers: int) -> dict:
    """The routing options of DeepSeek's MoE layers (none when every layer is dense)."""
    dense = hf.get("first_k_dense_replace", 3)
    if dense >= layers:
        return {}
    k = required_field(hf, "num_experts_per_tok", where)
    experts = required_field(hf, "n_routed_experts", where)
    ffn, shared = required_field(hf, "moe_intermediate_size", where), hf.get("n_shared_experts", 1)
    groups, chosen = hf.get("n_group") or 1, hf.get("topk_group") or 1
    limited = chosen < groups
    norm = hf.get("norm_topk_prob", True)
    refused = [
        (hf.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {hf.get('scoring_func')!r}: only sigmoid"),
        (
            hf.get("topk_method", "noaux_tc") != "noaux_tc",
            f"topk_method {hf.get('topk_method')!r}: transformers' DeepseekV3 routes as noaux_tc",
        ),
        (shared < 1, "n_shared_experts 0: the shared experts would be empty matrices"),
        (
            norm != (k > 1),
            f"norm_topk_prob {str(norm).lower()} with num_experts_per_tok {k}: Megatron's sigmoid router "
            "normalises the k weights exactly when k > 1",
        ),
        (
            limited and k // chosen != 2,
            f"num_experts_per_tok {k} with topk_group {chosen}: transformers scores a group by its top-2 "
            f"scores, Megatron's --moe-router-group-topk by its top-(topk/group-topk) = top-{k // chosen}",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise HFConversionError(f"{where}: {why}")
    scaling = float(hf.get("routed_scaling_factor", 2.5))
    return dict(
        num_experts=experts,
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (layers - dense),  # Megatron's list form
        moe_router_topk=k,
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=shared * ffn,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=chosen if limited else None,
    )


def mtp_depths(hf: dict, names: Iterable[str], where: str) -> int:
    """How many multi-token prediction depths the weights hold (decoder layers num_hidden_layers,
    +1, ... with an ``eh_proj``): 0, or num_nextn_predict_layers (transformers writes 1 by default,
    with no such weights)."""
    layers, names = hf["num_hidden_layers"], set(names)
    found = 0
    while f"model.layers.{layers + found}.eh_proj.weight" in names:
        found += 1
    declared = hf.get("num_nextn_predict_layers", 0)
    if found and found != declared:
        raise HFConversionError(
            f"{where}: num_nextn_predict_layers {declared}, but the weights hold {found} prediction layers "
            f"(model.layers.{layers}.eh_proj.weight ...)"
        )
    return found


def _yarn_values(rope: dict, where: str) -> dict:
    """--rotary-base, --rotary-scaling-factor, --mscale, --mscale-all-dim of ``rope_parameters``."""
    kind = rope_type(rope)
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
