"""Which Hugging Face architecture expresses a model of ours exactly, or why none does."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_p2r.config import ConfigError, ModelConfig

GPT2, LLAMA, MISTRAL, MIXTRAL, QWEN2 = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
)
MODEL_TYPES = {GPT2: "gpt2", LLAMA: "llama", MISTRAL: "mistral", MIXTRAL: "mixtral", QWEN2: "qwen2"}
ROTARY = (LLAMA, MISTRAL, MIXTRAL, QWEN2)


class HFConversionError(ConfigError):
    """A model or HF directory that cannot be converted; the message names the option or field."""


def _default(m: ModelConfig) -> Tuple[str, str]:
    """(architecture, why) chosen by the options when none is requested."""
    if m.num_experts:
        return MIXTRAL, "--num-experts is set"
    if m.position_embedding_type == "learned_absolute":
        return GPT2, "--position-embedding-type learned_absolute"
    if m.add_qkv_bias and not m.add_bias:
        return QWEN2, "--add-qkv-bias with --disable-bias-linear"
    if m.window_size is not None:
        return MISTRAL, "--window-size (Llama has no sliding window)"
    return LLAMA, "--position-embedding-type rope"


def _rotary_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """What none of the rotary architectures (Llama, Mistral, Mixtral, Qwen2) can represent."""
    name = arch.replace("ForCausalLM", "")
    return [
        (
            m.position_embedding_type != "rope",
            f"--position-embedding-type {m.position_embedding_type} ({name} uses rotary: rope)",
        ),
        (m.normalization != "RMSNorm", f"--normalization {m.normalization} ({name} uses RMSNorm)"),
        (not m.swiglu, f"no --swiglu ({name}'s MLP is SwiGLU)"),
        (m.rotary_percent != 1.0, f"--rotary-percent {m.rotary_percent} ({name} rotates whole heads)"),
        (m.qk_layernorm, f"--qk-layernorm ({name} has no query/key norms)"),
        (
            m.use_rope_scaling and m.rotary_seq_len_interpolation_factor is not None,
            "--use-rope-scaling with --rotary-seq-len-interpolation-factor (transformers takes one rope type)",
        ),
    ]


def _nowhere(m: ModelConfig) -> List[Tuple[bool, str]]:
    """Options none of the exported architectures has: gpt-oss's, multi-token prediction."""
    return [
        (bool(m.mtp_num_layers), f"--mtp-num-layers {m.mtp_num_layers} (multi-token prediction)"),
        (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type} (attention sinks)"),
        (m.quick_geglu, "--quick-geglu"),
        (m.glu_linear_offset != 0.0, f"--glu-linear-offset {m.glu_linear_offset}"),
        (m.activation_func_clamp_value is not None, f"--activation-func-clamp-value {m.activation_func_clamp_value}"),
    ]


def _windows(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    """Mistral and Mixtral window every layer; Qwen2 takes any pattern (layer_types)."""
    name = arch.replace("ForCausalLM", "")
    if arch in (GPT2, LLAMA):
        return [
            (
                m.window_size is not None,
                f"--window-size {m.window_size} ({name} has no sliding window; Mistral and Qwen2 have one)",
            )
        ]
    if arch in (MISTRAL, MIXTRAL):
        return [
            (
                m.window_size is not None and m.window_attn_skip_freq is not None,
                f"--window-attn-skip-freq {m.window_attn_skip_freq} ({name} windows every layer; Qwen2 expresses this)",
            )
        ]
    return []


def _biases(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    if arch == LLAMA:  # attention_bias: q, k, v and o; mlp_bias: the MLP
        return [
            (
                m.add_qkv_bias and not m.add_bias,
                "--add-qkv-bias without the other biases (Llama's "
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


def _blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
    return _nowhere(m) + _windows(m, arch) + _architecture_blockers(m, arch)


def _architecture_blockers(m: ModelConfig, arch: str) -> List[Tuple[bool, str]]:
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
            (bool(m.num_experts), "--num-experts (GPT2 is dense)"),
        ]
    blockers = _rotary_blockers(m, arch) + _biases(m, arch)
    if arch == MIXTRAL:
        return blockers + [
            (not m.num_experts, "no --num-experts (Mixtral's MLPs are top-k experts)"),
            (
                m.moe_layer_freq != 1,
                f"--moe-layer-freq {m.moe_layer_freq} (Mixtral has MoE in every layer; "
                "dense layers in between have no HF equivalent)",
            ),
            (
                m.moe_num_prototypes != 1,
                f"--moe-num-prototypes {m.moe_num_prototypes} (Mixtral routes top-k "
                "over all experts, not top-1 per prototype group)",
            ),
            (
                m.moe_router_pre_softmax,
                "--moe-router-pre-softmax (Mixtral always renormalises the top-k routing weights to sum to 1)",
            ),
            (
                m.moe_capacity_factor is not None,
                f"--moe-capacity-factor {m.moe_capacity_factor} (Mixtral is dropless; ours drops tokens over capacity)",
            ),
        ]
    name = arch.replace("ForCausalLM", "")
    return blockers + [(bool(m.num_experts), f"--num-experts ({name} is dense; Mixtral has experts)")]


def hf_architecture(m: ModelConfig, requested: Optional[str] = None) -> str:
    """The HF class that expresses ``m`` exactly (``requested``, or the one its options point to:
    GPT2, Llama, Qwen2 or Mixtral; Mistral only on request, since Llama expresses the same
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
