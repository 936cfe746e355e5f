"""Tensor-parallel layers (Megatron's ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).

A column-parallel linear splits its output features over TP ranks: its input is replicated
and its output stays split. A row-parallel linear splits its input features: its input is
split and its partial outputs are summed with one all-reduce. Column followed by row (the
MLP, attention) needs one all-reduce forward and one backward.

With sequence parallelism (``sequence_parallel=True``) the tensors between the TP regions are
sequence shards ``[b, s/TP, h]``: a column-parallel linear all-gathers its input along the
sequence (keeping only the shard for backward, as Megatron does, and gathering it again
there), a row-parallel linear and the embedding reduce-scatter their output instead of
all-reducing it. The biases added after the reduce-scatter then see 1/TP of the tokens: their
gradients are partial and are summed over TP with their data-parallel reduction
(``layout.tensor_specs.SEQUENCE_PARALLEL_PARTIAL``, the plan's ``Reduction.tp_block``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_p2r.parallel.mappings import (
    all_gather_sequence,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_region,
)
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on: what is gathered or saved as the input of a
    matmul (half the bytes of the fp32 residual stream)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class _GatheredLinear(torch.autograd.Function):
    """linear(all-gather of the sequence shard ``x``): saves the shard, not the gathered input;
    backward gathers it again for the weight gradient and reduce-scatters the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group).to(g.dtype).flatten(0, -2)
        g2 = g.flatten(0, -2)
        grad_x = reduce_scatter_sequence(g2.mm(weight.to(g.dtype)).view(*g.shape[:-1], -1), ctx.group)
        grad_w = g2.t().mm(full).to(weight.dtype)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_w, grad_b, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    sequence_parallel: bool,
) -> torch.Tensor:
    """``x`` (replicated, or a sequence shard) times a weight split along its output rows."""
    if sequence_parallel and group is not None:
        return _GatheredLinear.apply(to_compute_dtype(x), weight, bias, group)
    return F.linear(copy_to_region(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output rows: weight [out/TP, in]. With ``tp_replicas``
    k, A splits into TP/k shards, each held by k consecutive TP ranks (grouped-query attention's
    key/value heads when TP exceeds their number)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        gather_output: bool = False,
        tp_replicas: int = 1,
        sequence_parallel: bool = False,
        device=None,
    ):
        super().__init__()
        shards = ps.tp_size // tp_replicas
        if out_features % shards:
            raise ValueError(f"output size {out_features} not divisible into {shards} TP shards")
        self.group, self.gather_output, self.sequence_parallel = ps.group("tp"), gather_output, sequence_parallel
        local = out_features // shards
        self.weight = make_param(
            (local, in_features), tp_dim=0, init=("normal", init_std), tp_replicas=tp_replicas, device=device
        )
        self.bias = (
            make_param((local,), tp_dim=0, init=("zeros",), no_wd=True, tp_replicas=tp_replicas, device=device)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        y = column_parallel_linear(
            x, self.weight if weight is None else weight, self.bias, self.group, self.sequence_parallel
        )
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input columns: weight [out, in/TP]; input is split."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        device=None,
    ):
        super().__init__()
        if in_features % ps.tp_size:
            raise ValueError(f"input size {in_features} not divisible by TP={ps.tp_size}")
        self.group = ps.group("tp")
        self.reduce = reduce_scatter_to_sequence_region if sequence_parallel else reduce_from_region
        self.weight = make_param(
            (out_features, in_features // ps.tp_size), tp_dim=1, init=("normal", init_std), device=device
        )
        self.bias = make_param((out_features,), init=("zeros",), no_wd=True, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: weight [V/TP, h]; out-of-shard ids give 0.
    The partial lookups are summed over TP, into this rank's sequence shard under sequence
    parallelism (one reduce-scatter instead of an all-reduce)."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        ps: ParallelState,
        *,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        device=None,
    ):
        super().__init__()
        if num_embeddings % ps.tp_size:
            raise ValueError(f"vocabulary {num_embeddings} not divisible by TP={ps.tp_size}")
        self.group = ps.group("tp")
        self.reduce = reduce_scatter_to_sequence_region if sequence_parallel else reduce_from_region
        local = num_embeddings // ps.tp_size
        self.start = ps.tp_rank * local
        self.weight = make_param((local, dim), tp_dim=0, init=("normal", init_std), device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.weight, self.start, self.group, self.reduce)


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int, group, reduce: Callable) -> torch.Tensor:
    """Rows ``ids`` of a table split along the vocabulary (this rank's rows from ``start``), the
    partial lookups combined by ``reduce`` (all-reduce, or reduce-scatter into a sequence shard).
    Also the lookup of a replica of the table (multi-token prediction on the last stage)."""
    if group is None:
        return F.embedding(ids, weight)
    local_ids = ids - start
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    out = F.embedding(local_ids.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce(out, group)
