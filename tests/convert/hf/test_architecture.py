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
        (
            dict(ROPE, **GQA, qk_layernorm=True),
            "LlamaForCausalLM",
            "LlamaForCausalLM",
            "--qk-layernorm (Llama has no query/key norms; Qwen3 has them)",
        ),
        (dict(ROPE, **GQA, qk_layernorm=True), None, "Qwen3ForCausalLM", "biases in linear layers (Qwen3 has none"),
        (
            dict(ROPE, **GQA, disable_bias_linear=True),
            "Qwen3ForCausalLM",
            "Qwen3ForCausalLM",
            "no --qk-layernorm (Qwen3 normalises queries and keys)",
        ),
        (
            dict(ROPE, **GQA, disable_bias_linear=True, qk_layernorm=True, num_experts=4, moe_capacity_factor=1.0),
            None,
            "Qwen3MoeForCausalLM",
            "--moe-capacity-factor 1.0 (Qwen3Moe is dropless",
        ),
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
        # gpt-oss's options need its experts; Llama has no window, Mistral windows every layer
        (
            dict(ROPE, disable_bias_linear=True, softmax_type="learnable"),
            None,
            "LlamaForCausalLM",
            "--softmax-type learnable (attention sinks: GptOss has them)",
        ),
        (
            dict(ROPE, swiglu=False, quick_geglu=True, num_experts=4, disable_bias_linear=True),
            None,
            "GptOssForCausalLM",
            "--softmax-type vanilla (GptOss learns a sink per head: --softmax-type learnable); --glu-linear-offset "
            "0.0 (GptOss adds 1 to the linear half); no --activation-func-clamp-value (GptOss clamps its gated "
            "activation: swiglu_limit); --disable-bias-linear (GptOss's router and experts always have biases",
        ),
        (
            dict(ROPE, softmax_type="learnable", num_experts=4, moe_router_pre_softmax=True),
            None,
            "GptOssForCausalLM",
            "no --quick-geglu (GptOss's experts are quick-GeGLU)",
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
    """Options pick GPT2, Llama, Qwen2, Qwen3, Granite, Mixtral, Qwen3Moe or GraniteMoe; Mistral
    expresses Llama's bias-free models on request."""
    rope = dict(ROPE, **GQA, disable_bias_linear=True)
    assert hf_architecture(ModelConfig(**rope)) == "LlamaForCausalLM"
    assert hf_architecture(ModelConfig(**rope), "MistralForCausalLM") == "MistralForCausalLM"
    assert hf_architecture(ModelConfig(**rope, add_qkv_bias=True)) == "Qwen2ForCausalLM"
    assert hf_architecture(ModelConfig(**rope, window_size="7,0")) == "MistralForCausalLM"  # Llama has no window
    assert hf_architecture(ModelConfig(**rope, qk_layernorm=True, window_size="7,0")) == "Qwen3ForCausalLM"
    # Qwen3-MoE: dense layers between (decoder_sparse_step), top-k probabilities kept (norm_topk_prob false)
    moe = dict(rope, qk_layernorm=True, num_experts=4, moe_layer_freq=2, moe_router_pre_softmax=True)
    assert hf_architecture(ModelConfig(**moe)) == "Qwen3MoeForCausalLM"
    # OLMo 2: norms on the outputs, q/k norms over all heads; either alone is blocked elsewhere
    olmo = dict(rope, layer_norms="output", qk_layernorm=True, qk_layernorm_over_heads=True)
    assert hf_architecture(ModelConfig(**olmo)) == "Olmo2ForCausalLM"
    with pytest.raises(HFConversionError, match="no --qk-layernorm-over-heads"):
        hf_architecture(ModelConfig(**dict(olmo, qk_layernorm_over_heads=False)))
    with pytest.raises(HFConversionError, match=r"it maps to Gemma2ForCausalLM \(because --layer-norms both\)"):
        hf_architecture(ModelConfig(**rope, layer_norms="both"))  # Gemma has 4 norms a layer, and a GeGLU
    with pytest.raises(HFConversionError, match=r"--layer-norms both \(Llama has 2 norms a layer; Gemma has 4\)"):
        hf_architecture(ModelConfig(**rope, layer_norms="both"), "LlamaForCausalLM")
    with pytest.raises(HFConversionError, match=r"--qk-layernorm-over-heads \(Qwen3's query/key norms"):
        hf_architecture(ModelConfig(**rope, qk_layernorm=True, qk_layernorm_over_heads=True))
    # Granite: Llama or Mixtral with multipliers, which no other architecture has
    assert hf_architecture(ModelConfig(**rope, logits_scaling=2.0)) == "GraniteForCausalLM"
    assert hf_architecture(ModelConfig(**rope, num_experts=4, softmax_scale=0.1)) == "GraniteMoeForCausalLM"
    with pytest.raises(HFConversionError, match=r"--residual-multiplier \(Granite has it\)"):
        hf_architecture(ModelConfig(**rope, residual_multiplier=0.5), "LlamaForCausalLM")
    with pytest.raises(HFConversionError, match="--hf-architecture must be one of"):
        hf_architecture(ModelConfig(**rope), "PhiForCausalLM")
