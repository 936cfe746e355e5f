"""Dropout on a CP rank's tokens that draws the one-process run's masks.

A CP rank holds two chunks of every sequence (``context.chunks``). Its residual and embedding
dropout draw the mask of the whole sequence from the default RNG stream, which every CP rank
seeds alike (``parallel.random.seed_everything``), and keep their chunks' rows: the masks of the
one-process run, token for token, for CP times the random draws (the mask kept for backward is
the rank's own, as without CP). Under sequence parallelism the dropout draws from the
model-parallel stream on a TP shard, whose tokens are not a slice of the one-process run's: there
each (TP, CP) rank draws its own masks (``dropout_rng``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_p2r.context.chunks import split_sequence


def sequence_dropout(x: torch.Tensor, p: float, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``F.dropout(x, p)`` for ``x`` [b, s/CP, ...] holding CP rank ``cp_rank``'s chunks, with the
    mask F.dropout draws for the whole [b, s, ...] sequence (its ``noise``, so ``x * noise`` is
    the one-process product bitwise)."""
    if cp_size == 1 or p == 0.0:
        return F.dropout(x, p)
    whole = torch.ones(x.shape[0], x.shape[1] * cp_size, *x.shape[2:], dtype=x.dtype, device=x.device)
    return x * split_sequence(F.dropout(whole, p), cp_size, cp_rank, dim=1)
