"""Standard (multi-head, grouped-query) and multi-latent attention side by side, per layer.

    python benchmarks/attention_shapes.py

DeepSeek-V3's published attention shape (hidden 7168, 128 heads, query latent 1536, key/value
latent 512, 128 + 64 rotary query/key dimensions, 128 value dimensions) against multi-head and
grouped-query attention (8 groups) of 128 heads of 128 dimensions on the same hidden size.
Parameters per layer (whole, and on one rank of TP 8) are the model's tensors
(``layout.tensor_specs.attention_tensors``, what ``build_model`` allocates); the cache is what
inference keeps per token and layer in bf16 (keys and values; MLA's latent and shared rotary
key); training materialises full keys and values per head all the same (the next row). Forward
FLOPs per token at sequence 4096: 2 x the weights a token meets plus scores and values over the
whole square, Megatron's convention (``metrics.model_flops_per_token``). Nothing is measured.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.layout.tensor_specs import attention_tensors  # noqa: E402

SEQ, TP, BF16 = 4096, 8, 2
COMMON = dict(
    num_layers=1, hidden_size=7168, num_attention_heads=128, vocab_size=1024, seq_length=SEQ, disable_bias_linear=True
)
SHAPES = {
    "multi-head (128 x 128)": dict(kv_channels=128),
    "grouped-query (8 groups)": dict(kv_channels=128, group_query_attention=True, num_query_groups=8),
    "multi-latent (DeepSeek-V3)": dict(
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        qk_layernorm=True,
        normalization="RMSNorm",
    ),
}


def _row(m) -> List[str]:
    params = sum(s.numel for s in attention_tensors(m, "attention", 1))
    on_rank = sum(s.numel for s in attention_tensors(m, "attention", TP))
    heads = m.num_attention_heads
    if m.multi_latent_attention:
        cache = (m.kv_lora_rank + m.qk_pos_emb_head_dim) * BF16
        keys_values = heads * (m.q_head_dim + m.v_head_dim) * BF16
        core = 2 * SEQ * heads * (m.q_head_dim + m.v_head_dim)
    else:
        cache = keys_values = 2 * m.query_groups * m.head_dim * BF16
        core = 4 * SEQ * heads * m.head_dim
    flops = 2 * params + core
    return [
        f"{params / 1e6:.1f} M",
        f"{on_rank / 1e6:.1f} M",
        f"{cache:,} B",
        f"{keys_values:,} B",
        f"{flops / 1e9:.2f}",
    ]


def main(argv: Optional[List[str]] = None) -> None:
    header = [
        "attention",
        "params / layer",
        f"on a TP {TP} rank",
        "inference cache / token / layer",
        "keys + values in training / token / layer",
        f"forward GFLOP / token / layer (seq {SEQ})",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, options in SHAPES.items():
        m = config_from_values({**COMMON, **options}).model
        print("| " + " | ".join([name] + _row(m)) + " |")


if __name__ == "__main__":
    main()
