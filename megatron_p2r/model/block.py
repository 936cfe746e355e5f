"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)) (dense or MoE)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.model.attention import Attention
from megatron_p2r.model.mlp import MLP
from megatron_p2r.model.norm import make_norm
from megatron_p2r.moe.layer import MoELayer
from megatron_p2r.parallel.state import ParallelState


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, moe: bool, device=None):
        super().__init__()
        self.hidden_dropout = cfg.hidden_dropout
        self.input_norm = make_norm(cfg, device)
        self.attention = Attention(cfg, ps, device)
        self.post_attention_norm = make_norm(cfg, device)
        if moe:
            self.mlp = MoELayer(cfg, ps, device)
        else:
            self.mlp = MLP(cfg, ps, device=device)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        x = x + F.dropout(self.attention(self.input_norm(x), rope), p)
        return x + F.dropout(self.mlp(self.post_attention_norm(x)), p)
