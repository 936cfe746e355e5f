"""Adafactor's statistics as checkpoint entries (the factored form).

A piece of local shape (..., R, C) stores ``row_var`` of shape (..., R) and ``col_var`` of shape
(..., C): what the optimizer holds, 4 (R + C) bytes per matrix instead of 2 x 4 R C. A vector (n,)
is one row: ``row_var`` has shape () and ``col_var`` is its elementwise variance (n,). (For a
true vector the optimizer keeps no row statistic — one row's does not enter the estimate,
row x col / mean(row) = col — and 1 is stored; an expert's bias is a row of its stacked
parameter's matrix and stores that row's statistic.)

Under tensor parallelism each rank factors its own shard of a split weight. The statistic
reduced over the split dimension (``row_var`` when the columns are split, ``col_var`` when the
rows are) is the rank's own: each TP rank's file stores it with the same shape
(``split_dim`` None, ``per_rank``), and a reshard merges the ranks' values by their mean (a mean
over all columns is the mean of the ranks' means) and gives every new rank the merged value.
The other statistic is split like the weight, along the entry's own dimension.

Every value is *anchored* at one element of the piece — a row's statistic at the row's first
element, a column's at its element in the matrix's first row — and whoever writes that element
of the weight writes the value, so the fully parallel save's fragments tile each entry exactly
once (``anchored_range``).

Until issue 37 both were stored broadcast to the weight's shape (12 B per parameter on disk);
such checkpoints (metadata.json without ``factored_statistics``) still load and convert:
``entry_of`` takes their values from the broadcast tensors, as their loader always did.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

FACTOR_KINDS = ("row_var", "col_var")


def matrix_view(shape: Sequence[int]) -> Tuple[int, int, int]:
    """(matrices, rows, columns) of a piece: (..., R, C), a vector as one row."""
    shape = tuple(shape)
    if len(shape) < 2:
        return 1, 1, math.prod(shape)
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _kept_dims(ndim: int, kind: str) -> Tuple[int, ...]:
    """The weight's dimensions an entry keeps (``row_var`` drops the last, ``col_var`` the one before)."""
    if kind == "row_var":
        return tuple(range(ndim - 1))
    return tuple(range(max(ndim - 2, 0))) + (ndim - 1,)


def entry_shape(shape: Sequence[int], kind: str) -> Tuple[int, ...]:
    """The shape of entry ``kind`` of a piece of ``shape`` (local or global)."""
    return tuple(tuple(shape)[d] for d in _kept_dims(len(shape), kind))


def split_dim(ndim: int, tp_dim: Optional[int], kind: str) -> Optional[int]:
    """The entry's dimension split over TP (None: not split, or ``per_rank``)."""
    kept = _kept_dims(ndim, kind)
    return kept.index(tp_dim) if tp_dim in kept else None


def per_rank(ndim: int, tp_dim: Optional[int], kind: str) -> bool:
    """Whether each TP rank stores its own value of the entry (reduced over the split dimension)."""
    return tp_dim is not None and tp_dim not in _kept_dims(ndim, kind)


def _anchors_below(shape: Sequence[int], kind: str, x: int) -> int:
    """How many of the entry's values are anchored at elements before flat index ``x``."""
    _, r, c = matrix_view(shape)
    if kind == "row_var":
        return -(-x // c)
    return (x // (r * c)) * c + min(x % (r * c), c)


def anchored_range(shape: Sequence[int], kind: str, lo: int, hi: int) -> Tuple[int, int]:
    """The entry's flat values [a, b) anchored at the piece's elements [lo, hi)."""
    return _anchors_below(shape, kind, lo), _anchors_below(shape, kind, hi)


def anchors(shape: Sequence[int], kind: str) -> torch.Tensor:
    """The flat element of the piece each value of the entry is anchored at, in entry order."""
    b, r, c = matrix_view(shape)
    if kind == "row_var":
        return torch.arange(b * r) * c
    return (torch.arange(b)[:, None] * (r * c) + torch.arange(c)[None, :]).reshape(-1)


def entry_of(carrier: torch.Tensor, shape: Sequence[int], kind: str, lo: int = 0) -> torch.Tensor:
    """The entry's values anchored in ``carrier`` — a statistic broadcast over the piece's
    elements [lo, lo + carrier.numel()), as the optimizer gives it and older checkpoints stored
    it — flat, or in the entry's shape when the carrier is the whole piece."""
    flat = carrier.reshape(-1)
    a, b = anchored_range(shape, kind, lo, lo + flat.numel())
    values = flat[anchors(shape, kind)[a:b] - lo]
    whole = lo == 0 and flat.numel() == math.prod(shape)
    return values.view(entry_shape(shape, kind)) if whole else values


def carrier_of(entry: torch.Tensor, shape: Sequence[int], kind: str) -> torch.Tensor:
    """The entry broadcast over the piece of ``shape`` (what the optimizer's loader takes)."""
    b, r, c = matrix_view(shape)
    view = entry.reshape(b, r, 1) if kind == "row_var" else entry.reshape(b, 1, c)
    return view.expand(b, r, c).reshape(tuple(shape))
