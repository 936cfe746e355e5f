"""Model options export-hf refuses (naming each) for every Hugging Face architecture but
DeepseekV3ForCausalLM, which writes them (``convert/hf/deepseek_v3.py``); export-megatron
writes them all (docs/megatron.md, "DeepSeek-V3's pieces")."""

from __future__ import annotations

from typing import List, Tuple

from megatron_p2r.config import ModelConfig


def deepseek_routing_blockers(m: ModelConfig) -> List[Tuple[bool, str]]:
    """DeepSeek-style MoE options (docs/moe.md) that among the HF architectures only DeepseekV3 expresses."""
    return [
        (m.moe_router_score_function != "softmax", f"--moe-router-score-function {m.moe_router_score_function}"),
        (m.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor"),
        (m.moe_router_group_topk is not None, "--moe-router-group-topk (group-limited routing)"),
        (m.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (m.moe_shared_expert_intermediate_size is not None, "--moe-shared-expert-intermediate-size (shared experts)"),
    ]
