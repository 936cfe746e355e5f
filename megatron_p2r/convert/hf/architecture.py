"""Which Hugging Face architecture expresses a model of ours exactly, or why none does."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron_p2r.config import ConfigError, ModelConfig
from megatron_p2r.convert.unexported import deepseek_routing_blockers

GPT2, LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, GRANITE, GRANITE_MOE, OLMO2 = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "Olmo2ForCausalLM",
)
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
LATENT_NORM_EPSILON = 1e-6  # transformers' DeepseekV3 q_a_layernorm / kv_a_layernorm: fixed
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GEMMAS = (GEMMA2, GEMMA3)
GPT_OSS = "GptOssForCausalLM"
MODEL_TYPES = {
    GPT2: "gpt2",
    LLAMA: "llama",
    MISTRAL: "mistral",
    MIXTRAL: "mixtral",
    QWEN2: "qwen2",
    DEEPSEEK_V3: "deepseek_v3",
    QWEN3: "qwen3",
    QWEN3_MOE: "qwen3_moe",
    GRANITE: "granite",
    GRANITE_MOE: "granitemoe",
    OLMO2: "olmo2",
    GEMMA2: "gemma2",
    GEMMA3: "gemma3_text",
    GPT_OSS: "gpt_oss",
}
ROTARY = (LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, GRANITE, GRANITE_MOE, OLMO2) + GEMMAS
GRANITES = (GRANITE, GRANITE_MOE)  # Llama / Mixtral with multipliers (embedding, residual, attention, logits)
QK_NORMED = (QWEN3, QWEN3_MOE, OLMO2)  # query/key RMSNorms before rotary (--qk-layernorm)
MOE = (MIXTRAL, QWEN3_MOE, GRANITE_MOE)
# Windows: Mistral, Mixtral and Qwen3-MoE on every layer; Qwen2 and Qwen3 per layer (layer_types).
EVERY_LAYER_WINDOWED = (MISTRAL, MIXTRAL, QWEN3_MOE)

# Families import reads by name but refuses, and why (what the model here lacks).
REFUSED = {
    "gemma3": "this is Gemma 3's multimodal Gemma3ForConditionalGeneration (4B-27B as released: a vision "
    "tower and projector beside the language model); import reads its language model saved on its own "
    "as Gemma3ForCausalLM (model_type gemma3_text; docs/hf.md shows how)",
}


class HFConversionError(ConfigError):
    """A model or HF directory that cannot be converted; the message names the option or field."""


def _default(m: ModelConfig) -> Tuple[str, str]:
    """(architecture, why) chosen by the options when none is requested."""
    if m.multi_latent_attention:
        return DEEPSEEK_V3, "--multi-latent-attention"
    if m.num_experts:
        if m.quick_geglu or m.softmax_type != "vanilla":
            return GPT_OSS, "--num-experts with " + ("--quick-geglu" if m.quick_geglu else "--softmax-type")
        if _scaled(m):
            return GRANITE_MOE, "--num-experts with " + _scaled(m)[0]
        if m.qk_layernorm:
            return QWEN3_MOE, "--num-experts with --qk-layernorm"
        return MIXTRAL, "--num-experts is set"
    if m.position_embedding_type == "learned_absolute":
        return GPT2, "--position-embedding-type learned_absolute"
    if m.geglu or m.layer_norms == "both":
        gemma = GEMMA3 if m.qk_layernorm or m.rotary_base_local is not None else GEMMA2
        return gemma, "--geglu" if m.geglu else "--layer-norms both"
    if _scaled(m):
        return GRANITE, _scaled(m)[0]
    if m.layer_norms == "output":
        return OLMO2, "--layer-norms output"
    if m.qk_layernorm:
        return QWEN3, "--qk-layernorm"
    if m.add_qkv_bias and not m.add_bias:
        return QWEN2, "--add-qkv-bias with --disable-bias-linear"
    if m.window_size is not None:
        return MISTRAL, "--window-size (Llama has no sliding window)"
    return LLAMA, "--position-embedding-type rope"


def _scaled(m: ModelConfig) -> List[str]:
    """Granite's multipliers that ``m`` sets."""
    return [
        flag
        for flag, on in (
            ("--softmax-scale", m.softmax_scale is not None),
            ("--embedding-multiplier", m.embedding_multiplier != 1.0),
            ("--residual-multiplier", m.residual_multiplier != 1.0),
            ("--logits-scaling", m.logits_scaling != 1.0),
        )
        if on
    ]


def _rotary_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """What the rotary architectures (all but GPT2) cannot represent."""
    name = arch.replace("ForCausalLM", "")
    return [
        (
            m.position_embedding_type != "rope",
            f"--position-embedding-type {m.position_embedding_type} ({name} uses rotary: rope)",
        ),
        (m.normalization != "RMSNorm", f"--normalization {m.normalization} ({name} uses RMSNorm)"),
        (not m.swiglu, f"no --swiglu ({name}'s MLP is SwiGLU)")
        if arch != GPT_OSS
        else (not m.quick_geglu, "no --quick-geglu (GptOss's experts are quick-GeGLU)"),
        (m.rotary_percent != 1.0, f"--rotary-percent {m.rotary_percent} ({name} rotates whole heads)"),
        (
            m.qk_layernorm != (arch in QK_NORMED),
            f"no --qk-layernorm ({name} normalises queries and keys)"
            if arch in QK_NORMED
            else f"--qk-layernorm ({name} has no query/key norms; Qwen3 has them)",
        ),
        (m.qk_l2_norm, f"--qk-l2-norm ({name} has no query/key L2 norm)"),
        (
            m.use_rope_scaling and m.rotary_seq_len_interpolation_factor is not None,
            "--use-rope-scaling with --rotary-seq-len-interpolation-factor (transformers takes one rope type)",
        ),
    ]


def _latent_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """Multi-latent attention and multi-token prediction are DeepSeek-V3's only."""
    name = arch.replace("ForCausalLM", "").replace("LMHeadModel", "")
    if arch != DEEPSEEK_V3:
        return [
            (m.multi_latent_attention, f"--multi-latent-attention ({name} has standard attention)"),
            (
                bool(m.mtp_num_layers),
                f"--mtp-num-layers {m.mtp_num_layers} (multi-token prediction: DeepseekV3's files hold it)",
            ),
        ]
    return [
        (not m.multi_latent_attention, "no --multi-latent-attention (DeepseekV3's attention is latent)"),
        (not m.qk_layernorm, "no --qk-layernorm (DeepseekV3 always normalises its latents)"),
        (m.position_embedding_type != "rope", "--position-embedding-type learned_absolute (DeepseekV3 has none)"),
        (m.normalization != "RMSNorm", f"--normalization {m.normalization} (DeepseekV3 uses RMSNorm)"),
        (not m.swiglu, "no --swiglu (DeepseekV3's MLP is SwiGLU)"),
        (m.add_bias, "biases in linear layers (DeepseekV3's attention_bias would bias its down-projections too)"),
        (
            m.norm_epsilon != LATENT_NORM_EPSILON,
            f"--norm-epsilon {m.norm_epsilon} (transformers' DeepseekV3 normalises its latents with eps "
            f"{LATENT_NORM_EPSILON} whatever rms_norm_eps says; ours with --norm-epsilon)",
        ),
    ] + _deepseek_moe_blockers(m)


def dense_first_layers(m: ModelConfig) -> Optional[int]:
    """DeepSeek-V3's first_k_dense_replace for ``m``: the dense layers before the first MoE one, when
    every layer after them is MoE (None otherwise: DeepseekV3 cannot say it)."""
    moe = [m.is_moe_layer(i) for i in range(m.num_layers)]
    first = moe.index(True) if True in moe else m.num_layers
    return first if all(moe[first:]) else None


def _deepseek_moe_blockers(m: ModelConfig) -> List[Tuple[bool, str]]:
    """What DeepseekV3's MoE cannot say: it routes by sigmoid scores, always adds its expert bias
    (e_score_correction_bias) to choose, scores a group by its top-2 scores, runs ungated shared
    experts of n_shared_experts x moe_intermediate_size, drops no token."""
    if not m.num_experts:
        return []
    k, g = m.moe_router_topk, m.moe_router_group_topk
    shared, ffn = m.shared_expert_ffn_size, m.expert_ffn_size
    return [
        (
            dense_first_layers(m) is None,
            f"--moe-layer-freq {m.moe_layer_freq} (DeepseekV3's MoE layers are all those after its "
            "first_k_dense_replace dense ones)",
        ),
        (
            m.moe_router_score_function != "sigmoid",
            f"--moe-router-score-function {m.moe_router_score_function} (DeepseekV3's router scores are sigmoid)",
        ),
        (
            g is not None and k // g != 2,
            f"--moe-router-topk {k} with --moe-router-group-topk {g} (Megatron scores a group by its "
            f"top-{k // (g or 1)} scores, transformers' DeepseekV3 by its top-2)",
        ),
        (not shared, "no --moe-shared-expert-intermediate-size (DeepseekV3's MoE layers have shared experts)"),
        (
            shared % ffn != 0,
            f"--moe-shared-expert-intermediate-size {shared} (DeepseekV3's is n_shared_experts x "
            f"moe_intermediate_size {ffn})",
        ),
        (m.moe_shared_expert_gate, "--moe-shared-expert-gate (DeepseekV3's shared experts are not gated)"),
        (m.moe_num_prototypes != 1, f"--moe-num-prototypes {m.moe_num_prototypes} (DeepseekV3 routes top-k)"),
        (
            m.moe_capacity_factor is not None,
            f"--moe-capacity-factor {m.moe_capacity_factor} (DeepseekV3 is dropless; ours drops tokens over capacity)",
        ),
    ]


def _nowhere(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """gpt-oss's options, outside GptOss."""
    if arch == GPT_OSS:
        return []
    return [
        (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type} (attention sinks: GptOss has them)"),
        (m.quick_geglu, "--quick-geglu"),
        (m.glu_linear_offset != 0.0, f"--glu-linear-offset {m.glu_linear_offset}"),
        (m.activation_func_clamp_value is not None, f"--activation-func-clamp-value {m.activation_func_clamp_value}"),
    ]


def _windows(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """Mistral, Mixtral and Qwen3-MoE window every layer; Qwen2 and Qwen3 take any pattern (layer_types)."""
    name = arch.replace("ForCausalLM", "")
    if arch in (GPT2, LLAMA, OLMO2, DEEPSEEK_V3) + GRANITES:
        return [
            (
                m.window_size is not None,
                f"--window-size {m.window_size} ({name} has no sliding window; Mistral and Qwen2 have one)",
            )
        ]
    if arch in EVERY_LAYER_WINDOWED:
        return [
            (
                m.window_size is not None and m.window_attn_skip_freq is not None,
                f"--window-attn-skip-freq {m.window_attn_skip_freq} ({name} windows every layer; Qwen2 expresses this)",
            )
        ]
    return []


def _biases(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    if arch in (LLAMA, GRANITE):  # attention_bias: q, k, v and o; mlp_bias: the MLP
        return [
            (
                m.add_qkv_bias and not m.add_bias,
                f"--add-qkv-bias without the other biases ({arch.replace('ForCausalLM', '')}'s "
                "attention_bias also biases the output projection; Qwen2 "
                "expresses this)",
            )
        ]
    if arch == QWEN2:
        return [
            (
                m.add_bias,
                "biases outside the query/key/value projections (Qwen2 has those only; pass "
                "--disable-bias-linear --add-qkv-bias)",
            ),
            (not m.qkv_bias, "no --add-qkv-bias (Qwen2 always biases the query/key/value projections)"),
        ]
    name = arch.replace("ForCausalLM", "")
    return [(m.qkv_bias, f"biases in linear layers ({name} has none; pass --disable-bias-linear)")]


def _gemma_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """Gemma 2 and 3 (convert/hf/gemma.py): Llama's rotary attention without biases, a tanh-GeGLU
    MLP, norms on both sides of attention and the MLP, the embedding times sqrt(hidden), any
    --softmax-scale that is q**-0.5 for an integer q (query_pre_attn_scalar); Gemma 3 per-head
    q/k norms and --rotary-base-local, Gemma 2 neither; every other architecture none of it."""
    name = arch.replace("ForCausalLM", "").replace("LMHeadModel", "")
    ours = [
        (m.attn_logit_softcapping is not None, "--attn-logit-softcapping"),
        (m.final_logit_softcapping is not None, "--final-logit-softcapping"),
        (m.geglu, "--geglu"),
        (m.rotary_base_local is not None, "--rotary-base-local"),
    ]
    if arch not in GEMMAS:
        return [(on, f"{flag} ({name} has none; Gemma has it)") for on, flag in ours] + [
            (m.layer_norms == "both", f"--layer-norms both ({name} has 2 norms a layer; Gemma has 4)")
        ]
    from_hidden = {float(torch.tensor(m.hidden_size**0.5, dtype=d)) for d in (torch.float32, torch.bfloat16)}
    scale = m.softmax_scale if m.softmax_scale is not None else m.head_dim**-0.5
    gemma3 = arch == GEMMA3
    return [
        (
            m.position_embedding_type != "rope",
            f"--position-embedding-type {m.position_embedding_type} ({name} uses rope)",
        ),
        (m.normalization != "RMSNorm", f"--normalization {m.normalization} ({name} uses RMSNorm)"),
        (not m.geglu, f"no --geglu ({name}'s MLP is GeGLU with tanh GELU)"),
        (m.layer_norms != "both", f"--layer-norms {m.layer_norms} ({name} normalises inputs and outputs: both)"),
        (m.rotary_percent != 1.0, f"--rotary-percent {m.rotary_percent} ({name} rotates whole heads)"),
        (m.use_rope_scaling, f"--use-rope-scaling ({name} is exported with default or linear rotary only)"),
        (m.yarn, f"--rope-type yarn ({name} is exported with default or linear rotary only)"),
        (
            m.qk_layernorm != gemma3,
            "no --qk-layernorm (Gemma3 normalises each query and key head)"
            if gemma3
            else "--qk-layernorm (Gemma2 has no query/key norms; Gemma3 has them)",
        ),
        (m.qk_layernorm_over_heads, f"--qk-layernorm-over-heads ({name}'s q/k norms are per head)"),
        (m.qk_l2_norm, f"--qk-l2-norm ({name} has no query/key L2 norm)"),
        (not gemma3 and m.rotary_base_local is not None, "--rotary-base-local (Gemma2 has one rotary base)"),
        (
            m.embedding_multiplier not in from_hidden,
            f"--embedding-multiplier {m.embedding_multiplier} ({name} scales by sqrt(hidden size) = "
            f"{m.hidden_size**0.5})",
        ),
        (
            round(scale**-2) ** -0.5 != scale,
            f"--softmax-scale {scale} ({name}'s is query_pre_attn_scalar**-0.5 for an integer query_pre_attn_scalar)",
        ),
        (m.residual_multiplier != 1.0, f"--residual-multiplier ({name} has none; Granite has it)"),
        (m.logits_scaling != 1.0, f"--logits-scaling ({name} has none; Granite has it)"),
        (m.add_bias or m.add_qkv_bias, f"biases in linear layers ({name} has none; pass --disable-bias-linear)"),
        (bool(m.num_experts), f"--num-experts ({name} is dense)"),
    ]


def _deepseek_only(m: ModelConfig) -> List[Tuple[bool, str]]:
    """DeepSeek's routing options, for the architectures that lack them."""
    return [(bad, f"{flag} (DeepseekV3 expresses it)") for bad, flag in deepseek_routing_blockers(m)]


def _blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    if arch in GEMMAS:
        return _nowhere(m, arch) + _gemma_blockers(m, arch) + _latent_blockers(m, arch) + _deepseek_only(m)
    scaled = [] if arch in GRANITES else [(True, f"{flag} (Granite has it)") for flag in _scaled(m)]
    return (
        _nowhere(m, arch)
        + scaled
        + _norm_blockers(m, arch)
        + _windows(m, arch)
        + _latent_blockers(m, arch)
        + _architecture_blockers(m, arch)
        + _gemma_blockers(m, arch)
    )


def _norm_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """OLMo 2 normalises the outputs of attention and the MLP (not their inputs) and its query/key
    norms span all heads; every other architecture the inputs, per head."""
    name, olmo = arch.replace("ForCausalLM", "").replace("LMHeadModel", ""), arch == OLMO2
    where = "outputs" if olmo else "inputs"
    return [
        (
            m.layer_norms != ("output" if olmo else "input"),
            f"--layer-norms {m.layer_norms} ({name} normalises the {where} of attention and the MLP)",
        ),
        (
            m.qk_layernorm and m.qk_layernorm_over_heads != olmo,
            "no --qk-layernorm-over-heads (Olmo2's query/key norms span all heads)"
            if olmo
            else f"--qk-layernorm-over-heads ({name}'s query/key norms, if any, are per head; Olmo2's span all heads)",
        ),
    ]


def _architecture_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    if arch == DEEPSEEK_V3:
        return []
    if arch == GPT2:
        return [
            (
                m.position_embedding_type != "learned_absolute",
                f"--position-embedding-type {m.position_embedding_type} (GPT2 learns positions)",
            ),
            (m.normalization != "LayerNorm", f"--normalization {m.normalization} (GPT2 uses LayerNorm)"),
            (m.swiglu, "--swiglu (GPT2's MLP is GELU)"),
            (m.group_query_attention, "--group-query-attention (GPT2 has one key/value head per query head)"),
            (
                m.head_dim * m.num_attention_heads != m.hidden_size,
                f"--kv-channels {m.kv_channels} (GPT2's heads split the hidden size)",
            ),
            (m.qk_layernorm, "--qk-layernorm (GPT2 has no query/key norms)"),
            (m.qk_l2_norm, "--qk-l2-norm (GPT2 has no query/key norms)"),
            (bool(m.num_experts), "--num-experts (GPT2 is dense)"),
        ]
    if arch == GPT_OSS:
        return _rotary_blockers(m, arch) + _deepseek_only(m) + _gpt_oss_blockers(m)
    blockers = _rotary_blockers(m, arch) + _biases(m, arch) + _deepseek_only(m)
    name = arch.replace("ForCausalLM", "")
    if arch in MOE:
        return blockers + _moe_blockers(m, name)
    return blockers + [(bool(m.num_experts), f"--num-experts ({name} is dense; Mixtral and Qwen3Moe have experts)")]


def _gpt_oss_blockers(m: ModelConfig) -> List[Tuple[bool, str]]:
    """GptOss: sinks, clamped quick-GeGLU (x + 1 on the linear half) in top-k experts on every
    layer, biases everywhere (attention, router, experts)."""
    return _moe_blockers(m, "GptOss") + [
        (
            m.softmax_type != "learnable",
            f"--softmax-type {m.softmax_type} (GptOss learns a sink per head: --softmax-type learnable)",
        ),
        (m.glu_linear_offset != 1.0, f"--glu-linear-offset {m.glu_linear_offset} (GptOss adds 1 to the linear half)"),
        (
            m.activation_func_clamp_value is None,
            "no --activation-func-clamp-value (GptOss clamps its gated activation: swiglu_limit)",
        ),
        (
            not m.add_bias,
            "--disable-bias-linear (GptOss's router and experts always have biases; its attention_bias the rest)",
        ),
        (m.add_bias and not m.router_bias, "--no-moe-router-bias (GptOss's router always has a bias)"),
    ]


def _moe_blockers(m: ModelConfig, name: str) -> List[Tuple[bool, str]]:
    """Mixtral and Granite-MoE: top-k renormalised, every layer; Qwen3-MoE also takes dense layers
    between (decoder_sparse_step) and the top-k probabilities as they are (norm_topk_prob false)."""
    mixtral = name != "Qwen3Moe"  # GptOss too: MoE in every layer, top-k renormalised
    return [
        (not m.num_experts, f"no --num-experts ({name}'s MLPs are top-k experts)"),
        (
            mixtral and not m.all_layers_moe,
            f"--moe-layer-freq {m.moe_layer_freq} ({name} has MoE in every layer; Qwen3Moe expresses this)",
        ),
        (
            m.moe_num_prototypes != 1,
            f"--moe-num-prototypes {m.moe_num_prototypes} ({name} routes top-k "
            "over all experts, not top-1 per prototype group)",
        ),
        (
            mixtral and m.moe_router_pre_softmax,
            f"--moe-router-pre-softmax ({name} always renormalises the top-k routing weights to sum to 1)",
        ),
        (
            m.moe_capacity_factor is not None,
            f"--moe-capacity-factor {m.moe_capacity_factor} ({name} is dropless; ours drops tokens over capacity)",
        ),
    ]


def hf_architecture(m: ModelConfig, requested: Optional[str] = None) -> str:
    """The HF class that expresses ``m`` exactly (``requested``, or the one its options point to:
    GPT2, Llama, Qwen2, Qwen3, Granite, Olmo2, Gemma2, Gemma3, Mixtral, Qwen3Moe, GraniteMoe or GptOss; Mistral only on request, since Llama expresses the same
    models), or an error listing every option that blocks it."""
    if requested is None:
        arch, why = _default(m)
    elif requested in MODEL_TYPES:
        arch, why = requested, "--hf-architecture asks for it"
    else:
        raise HFConversionError(f"--hf-architecture must be one of {', '.join(MODEL_TYPES)}; got {requested!r}")
    found = [msg for bad, msg in _blockers(m, arch) if bad]
    if found:
        raise HFConversionError(
            f"cannot express this model in Hugging Face transformers: it maps to {arch} "
            f"(because {why}), which cannot represent: " + "; ".join(found)
        )
    return arch
