"""Which Hugging Face architecture expresses a model of ours exactly, or why none does."""
from __future__ import annotations

from megatron_p2r.config import ConfigError, ModelConfig

GPT2, LLAMA, MIXTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM"
MODEL_TYPES = {GPT2: "gpt2", LLAMA: "llama", MIXTRAL: "mixtral"}


class HFConversionError(ConfigError):
    """A model or HF directory that cannot be converted; the message names the option or field."""


def hf_architecture(m: ModelConfig) -> str:
    """The HF class that expresses ``m`` exactly, or an error listing every option that blocks it."""
    if m.num_experts:
        arch, why = MIXTRAL, "--num-experts is set"
        blockers = [
            (m.position_embedding_type != "rope", f"--position-embedding-type {m.position_embedding_type} "
                                                  "(Mixtral uses rotary: rope)"),
            (m.normalization != "RMSNorm", f"--normalization {m.normalization} (Mixtral uses RMSNorm)"),
            (not m.swiglu, "no --swiglu (Mixtral experts are SwiGLU)"),
            (m.moe_layer_freq != 1, f"--moe-layer-freq {m.moe_layer_freq} (Mixtral has MoE in every layer; "
                                    "dense layers in between have no HF equivalent)"),
            (m.moe_num_prototypes != 1, f"--moe-num-prototypes {m.moe_num_prototypes} (Mixtral routes top-k "
                                        "over all experts, not top-1 per prototype group)"),
            (m.moe_router_pre_softmax, "--moe-router-pre-softmax (Mixtral always renormalises the top-k "
                                       "routing weights to sum to 1)"),
            (m.moe_capacity_factor is not None, f"--moe-capacity-factor {m.moe_capacity_factor} (Mixtral is "
                                                "dropless; ours drops tokens over capacity)"),
            (m.add_bias, "biases in linear layers (Mixtral has none; pass --disable-bias-linear)"),
        ]
    elif m.position_embedding_type == "learned_absolute":
        arch, why = GPT2, "--position-embedding-type learned_absolute"
        blockers = [
            (m.normalization != "LayerNorm", f"--normalization {m.normalization} (GPT2 uses LayerNorm)"),
            (m.swiglu, "--swiglu (GPT2's MLP is GELU)"),
        ]
    else:
        arch, why = LLAMA, "--position-embedding-type rope"
        blockers = [
            (m.normalization != "RMSNorm", f"--normalization {m.normalization} (Llama uses RMSNorm)"),
            (not m.swiglu, "no --swiglu (Llama's MLP is SwiGLU)"),
        ]
    found = [msg for bad, msg in blockers if bad]
    if found:
        raise HFConversionError(f"cannot express this model in Hugging Face transformers: it maps to {arch} "
                                f"(because {why}), which cannot represent: " + "; ".join(found))
    return arch
