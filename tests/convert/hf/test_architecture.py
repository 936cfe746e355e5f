"""Which HF architecture a model maps to, and every option that blocks it, named."""

import pytest

from megatron_p2r.convert.hf.architecture import HFConversionError, hf_architecture
from megatron_p2r.config import ModelConfig
from tests.convert.hf.common import ROPE


@pytest.mark.parametrize(
    "values, arch, blocked",
    [
        (dict(ROPE, normalization="LayerNorm"), "LlamaForCausalLM", "--normalization LayerNorm"),
        (dict(ROPE, swiglu=False), "LlamaForCausalLM", "no --swiglu"),
        (dict(normalization="RMSNorm"), "GPT2LMHeadModel", "--normalization RMSNorm"),
        (dict(swiglu=True), "GPT2LMHeadModel", "--swiglu"),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_layer_freq=2),
            "MixtralForCausalLM",
            "--moe-layer-freq 2",
        ),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_num_prototypes=2),
            "MixtralForCausalLM",
            "--moe-num-prototypes 2",
        ),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_router_pre_softmax=True),
            "MixtralForCausalLM",
            "--moe-router-pre-softmax",
        ),
        (dict(ROPE, num_experts=4), "MixtralForCausalLM", "biases in linear layers"),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_shared_expert_intermediate_size=8),
            "MixtralForCausalLM",
            "--moe-shared-expert-intermediate-size (shared experts)",
        ),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_router_score_function="sigmoid"),
            "MixtralForCausalLM",
            "--moe-router-score-function sigmoid",
        ),
        (
            dict(ROPE, num_experts=4, disable_bias_linear=True, moe_capacity_factor=1.0),
            "MixtralForCausalLM",
            "--moe-capacity-factor 1.0",
        ),
        (
            dict(num_experts=4, disable_bias_linear=True),
            "MixtralForCausalLM",
            "--position-embedding-type learned_absolute",
        ),
    ],
)
def test_inexpressible_configs_name_the_option(values, arch, blocked):
    with pytest.raises(HFConversionError, match="cannot express") as exc:
        hf_architecture(ModelConfig(**values))
    assert arch in str(exc.value) and blocked in str(exc.value)


GQA = dict(group_query_attention=True, num_query_groups=2)


@pytest.mark.parametrize(
    "values, requested, arch, blocked",
    [
        (GQA, None, "GPT2LMHeadModel", "--group-query-attention (GPT2 has one key/value head per query head)"),
        (dict(kv_channels=16), None, "GPT2LMHeadModel", "--kv-channels 16"),
        (dict(ROPE, rotary_percent=0.5), None, "LlamaForCausalLM", "--rotary-percent 0.5 (Llama rotates whole heads)"),
        (dict(ROPE, **GQA, qk_layernorm=True), None, "LlamaForCausalLM", "--qk-layernorm"),
        (dict(ROPE, **GQA), "MistralForCausalLM", "MistralForCausalLM", "biases in linear layers (Mistral has none"),
        (dict(ROPE, **GQA, disable_bias_linear=True), "Qwen2ForCausalLM", "Qwen2ForCausalLM", "no --add-qkv-bias"),
        (dict(ROPE, add_qkv_bias=True), "Qwen2ForCausalLM", "Qwen2ForCausalLM", "biases outside the query/key/value"),
        (
            dict(ROPE, add_qkv_bias=True, disable_bias_linear=True),
            "LlamaForCausalLM",
            "LlamaForCausalLM",
            "--add-qkv-bias without the other biases",
        ),
        (dict(ROPE, disable_bias_linear=True), "MixtralForCausalLM", "MixtralForCausalLM", "no --num-experts"),
        # gpt-oss's options have no exported architecture; Llama has no window, Mistral windows every layer
        (
            dict(ROPE, disable_bias_linear=True, softmax_type="learnable"),
            None,
            "LlamaForCausalLM",
            "--softmax-type learnable (attention sinks)",
        ),
        (
            dict(ROPE, swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0),
            None,
            "LlamaForCausalLM",
            "--quick-geglu; --glu-linear-offset 1.0; --activation-func-clamp-value 7.0",
        ),
        (
            dict(ROPE, disable_bias_linear=True, window_size="7,0"),
            "LlamaForCausalLM",
            "LlamaForCausalLM",
            "--window-size 7,0 (Llama has no sliding window; Mistral and Qwen2 have one)",
        ),
        (
            dict(ROPE, disable_bias_linear=True, window_size="7,0", window_attn_skip_freq=2),
            None,
            "MistralForCausalLM",
            "--window-attn-skip-freq 2 (Mistral windows every layer; Qwen2 expresses this)",
        ),
    ],
)
def test_attention_options_and_requested_architectures(values, requested, arch, blocked):
    with pytest.raises(HFConversionError, match="cannot express") as exc:
        hf_architecture(ModelConfig(**values), requested)
    assert arch in str(exc.value) and blocked in str(exc.value)


def test_architecture_choice():
    """Options pick GPT2, Llama, Qwen2 or Mixtral; Mistral expresses Llama's bias-free models on request."""
    rope = dict(ROPE, **GQA, disable_bias_linear=True)
    assert hf_architecture(ModelConfig(**rope)) == "LlamaForCausalLM"
    assert hf_architecture(ModelConfig(**rope), "MistralForCausalLM") == "MistralForCausalLM"
    assert hf_architecture(ModelConfig(**rope, add_qkv_bias=True)) == "Qwen2ForCausalLM"
    assert hf_architecture(ModelConfig(**rope, window_size="7,0")) == "MistralForCausalLM"  # Llama has no window
    with pytest.raises(HFConversionError, match="--hf-architecture must be one of"):
        hf_architecture(ModelConfig(**rope), "Qwen3ForCausalLM")
