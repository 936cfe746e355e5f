"""Which HF architecture a model maps to, and every option that blocks it, named."""
import pytest

from megatron_p2r.convert.hf.architecture import HFConversionError, hf_architecture
from megatron_p2r.config import ModelConfig
from tests.convert.hf.common import ROPE


@pytest.mark.parametrize("values, arch, blocked", [
    (dict(ROPE, normalization="LayerNorm"), "LlamaForCausalLM", "--normalization LayerNorm"),
    (dict(ROPE, swiglu=False), "LlamaForCausalLM", "no --swiglu"),
    (dict(normalization="RMSNorm"), "GPT2LMHeadModel", "--normalization RMSNorm"),
    (dict(swiglu=True), "GPT2LMHeadModel", "--swiglu"),
    (dict(ROPE, num_experts=4, disable_bias_linear=True, moe_layer_freq=2),
     "MixtralForCausalLM", "--moe-layer-freq 2"),
    (dict(ROPE, num_experts=4, disable_bias_linear=True, moe_num_prototypes=2),
     "MixtralForCausalLM", "--moe-num-prototypes 2"),
    (dict(ROPE, num_experts=4, disable_bias_linear=True, moe_router_pre_softmax=True), "MixtralForCausalLM",
     "--moe-router-pre-softmax"),
    (dict(ROPE, num_experts=4), "MixtralForCausalLM", "biases in linear layers"),
    (dict(ROPE, num_experts=4, disable_bias_linear=True, moe_capacity_factor=1.0),
     "MixtralForCausalLM", "--moe-capacity-factor 1.0"),
    (dict(num_experts=4, disable_bias_linear=True), "MixtralForCausalLM",
     "--position-embedding-type learned_absolute"),
])
def test_inexpressible_configs_name_the_option(values, arch, blocked):
    with pytest.raises(HFConversionError, match="cannot express") as exc:
        hf_architecture(ModelConfig(**values))
    assert arch in str(exc.value) and blocked in str(exc.value)


GQA = dict(group_query_attention=True, num_query_groups=2)


@pytest.mark.parametrize("values, requested, arch, blocked", [
    (GQA, None, "GPT2LMHeadModel", "--group-query-attention (GPT2 has one key/value head per query head)"),
    (dict(kv_channels=16), None, "GPT2LMHeadModel", "--kv-channels 16"),
    (dict(ROPE, rotary_percent=0.5), None, "LlamaForCausalLM", "--rotary-percent 0.5 (Llama rotates whole heads)"),
    (dict(ROPE, **GQA, qk_layernorm=True), None, "LlamaForCausalLM", "--qk-layernorm"),
    (dict(ROPE, **GQA), "MistralForCausalLM", "MistralForCausalLM", "biases in linear layers (Mistral has none"),
    (dict(ROPE, **GQA, disable_bias_linear=True), "Qwen2ForCausalLM", "Qwen2ForCausalLM", "no --add-qkv-bias"),
    (dict(ROPE, add_qkv_bias=True), "Qwen2ForCausalLM", "Qwen2ForCausalLM", "biases outside the query/key/value"),
    (dict(ROPE, add_qkv_bias=True, disable_bias_linear=True), "LlamaForCausalLM", "LlamaForCausalLM",
     "--add-qkv-bias without the other biases"),
    (dict(ROPE, disable_bias_linear=True), "MixtralForCausalLM", "MixtralForCausalLM", "no --num-experts"),
])
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
    with pytest.raises(HFConversionError, match="--hf-architecture must be one of"):
        hf_architecture(ModelConfig(**rope), "Qwen3ForCausalLM")
