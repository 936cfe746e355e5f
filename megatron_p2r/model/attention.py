"""Causal self-attention with heads split over TP; the kernel is torch's SDPA."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.state import ParallelState


def rotary_tables(seq_len: int, head_dim: int, base: float, device) -> tuple:
    """cos, sin [seq, head_dim] in the rotate-half convention (as Llama in transformers)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    """QKV is one column-parallel matrix laid out per head as [heads, (q, k, v), head_dim],
    so a contiguous TP split gives each rank whole heads; the output is row-parallel."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None, *, sequence_parallel: bool = False,
                 recompute_core: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.local_heads = cfg.num_attention_heads // ps.tp_size
        self.dropout = cfg.attention_dropout
        self.device = ps.device
        self.recompute_core = recompute_core
        self.qkv = ColumnParallelLinear(h, 3 * h, ps, bias=cfg.add_bias, init_std=cfg.init_method_std,
                                        sequence_parallel=sequence_parallel, device=device)
        self.proj = RowParallelLinear(h, h, ps, bias=cfg.add_bias,
                                      init_std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      sequence_parallel=sequence_parallel, device=device)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        qkv = self.qkv(x)  # the whole sequence, also when x is a sequence shard
        b, s = qkv.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, self.local_heads, 3, self.head_dim).unbind(dim=3))
        if rope is not None:
            cos, sin = rope
            q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        if self.recompute_core and torch.is_grad_enabled():
            y = tp_random.checkpoint(self.core, q, k, v, device=self.device)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V with attention dropout: what selective recomputation
        (``recompute_core``, Megatron's "core_attn") recomputes in backward."""
        p = self.dropout if self.training else 0.0
        # Heads are split over TP, so their dropout masks must differ between TP ranks.
        with tp_random.get_rng_tracker(self.device).fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
