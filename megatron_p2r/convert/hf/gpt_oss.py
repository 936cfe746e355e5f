"""gpt-oss's config.json <-> our options (``GptOssForCausalLM``, transformers' ``gpt_oss``).

gpt-oss is Megatron-LM's gpt-oss recipe (docs/megatron.md): top-k experts on every layer whose
router has a bias (ours under biases: moe/router.py), clamped quick-GeGLU experts with the linear
half offset by 1 (``swiglu_limit``: --activation-func-clamp-value; ``swiglu_alpha`` must be
quick-GeGLU's 1.702), a learned sink per head (--softmax-type learnable), sliding windows on the
``layer_types`` marked so (--window-size, --window-attn-skip-freq), biases on the attention
(``attention_bias``, always true in released models: our biases are all or none) and YaRN
rotary scaling (``rope_parameters``: convert/hf/yarn.py). The tensors: convert/hf/rules.py.
"""

from __future__ import annotations

from typing import Optional

from megatron_p2r.config import ModelConfig
from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.config_schema import required_field
from megatron_p2r.convert.hf.yarn import yarn_values

QUICK_GELU_ALPHA = 1.702  # moe/activation.py's quick-GELU: x * sigmoid(1.702 x)
# GptOssConfig's defaults where config.json leaves them out
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_fields(m: ModelConfig, window: Optional[int]) -> dict:
    """GptOssConfig's fields for ``m`` beyond the rotary ones every architecture writes
    (``window``: transformers' sliding_window)."""
    return {
        "intermediate_size": m.expert_ffn_size,
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
        "output_router_logits": False,
        "sliding_window": window,
        "layer_types": [
            "full_attention" if m.attention_window(i) is None else "sliding_attention" for i in range(m.num_layers)
        ],
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": m.activation_func_clamp_value,
        "attention_bias": True,
    }


def gpt_oss_values(hf: dict, where: str) -> dict:
    """{ModelConfig field: value} that a gpt-oss config.json sets beyond a rotary model's, or an
    error naming the field."""
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise HFConversionError(
            f"{where}: swiglu_alpha {alpha} has no equivalent here (--quick-geglu's gate is x * sigmoid(1.702 x))"
        )
    if not hf.get("attention_bias", True):
        raise HFConversionError(
            f"{where}: attention_bias false with the router's and experts' biases has no equivalent here "
            "(--disable-bias-linear removes every bias or none)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")  # given: read as any rotary model's
    values = dict(
        swiglu=False,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        softmax_type="learnable",
        disable_bias_linear=False,
        num_experts=required_field(hf, "num_local_experts", where),
        moe_router_topk=required_field(hf, "num_experts_per_tok", where),
        moe_layer_freq=1,
        moe_ffn_hidden_size=required_field(hf, "intermediate_size", where),
        moe_router_pre_softmax=False,
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001),
        rotary_base=float((rope or {}).get("rope_theta", hf.get("rope_theta", DEFAULT_THETA))),
    )
    if rope is None:  # GptOssConfig's default is YaRN
        values.update(yarn_values(DEFAULT_ROPE, hf.get("max_position_embeddings", 131072), where))
    return values
