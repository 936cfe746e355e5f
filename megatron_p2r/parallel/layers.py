"""Tensor-parallel layers (Megatron's ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).

A column-parallel linear splits its output features over TP ranks: its input is replicated
and its output stays split. A row-parallel linear splits its input features: its input is
split and its partial outputs are summed with one all-reduce. Column followed by row (the
MLP, attention) needs one all-reduce forward and one backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.parallel.mappings import copy_to_region, gather_from_region, reduce_from_region
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output rows: weight [out/TP, in]. With ``tp_replicas``
    k, A splits into TP/k shards, each held by k consecutive TP ranks (grouped-query attention's
    key/value heads when TP exceeds their number)."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, *, bias: bool = True,
                 init_std: float = 0.02, gather_output: bool = False, tp_replicas: int = 1, device=None):
        super().__init__()
        shards = ps.tp_size // tp_replicas
        if out_features % shards:
            raise ValueError(f"output size {out_features} not divisible into {shards} TP shards")
        self.group, self.gather_output = ps.group("tp"), gather_output
        local = out_features // shards
        self.weight = make_param((local, in_features), tp_dim=0, init=("normal", init_std), tp_replicas=tp_replicas,
                                 device=device)
        self.bias = make_param((local,), tp_dim=0, init=("zeros",), no_wd=True, tp_replicas=tp_replicas,
                               device=device) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        x = copy_to_region(x, self.group)
        y = F.linear(x, self.weight if weight is None else weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input columns: weight [out, in/TP]; input is split."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, *, bias: bool = True,
                 init_std: float = 0.02, device=None):
        super().__init__()
        if in_features % ps.tp_size:
            raise ValueError(f"input size {in_features} not divisible by TP={ps.tp_size}")
        self.group = ps.group("tp")
        self.weight = make_param((out_features, in_features // ps.tp_size), tp_dim=1,
                                 init=("normal", init_std), device=device)
        self.bias = make_param((out_features,), init=("zeros",), no_wd=True, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: weight [V/TP, h]; out-of-shard ids give 0."""

    def __init__(self, num_embeddings: int, dim: int, ps: ParallelState, *, init_std: float = 0.02, device=None):
        super().__init__()
        if num_embeddings % ps.tp_size:
            raise ValueError(f"vocabulary {num_embeddings} not divisible by TP={ps.tp_size}")
        self.group = ps.group("tp")
        local = num_embeddings // ps.tp_size
        self.start = ps.tp_rank * local
        self.weight = make_param((local, dim), tp_dim=0, init=("normal", init_std), device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        local_ids = ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(out, self.group)
