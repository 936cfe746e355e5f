"""Which HF architecture a model maps to, and every option that blocks it, named."""
import pytest

from megatron_p2r.checkpoint.hf.architecture import HFConversionError, hf_architecture
from megatron_p2r.config import ModelConfig
from tests.checkpoint.hf.common import ROPE


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
