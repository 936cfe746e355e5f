"""Which (query chunk, key chunk) blocks of causal attention a CP rank must compute, and how.

Pure arithmetic on token positions, tested against a dense mask without processes. The rule is
the one-process mask (``model.attention.window_mask``): query i sees key j iff
``i - window <= j <= i`` (no window: ``j <= i``). A block of queries [q0, q0 + n) against keys
[k0, k0 + n) covers the distances ``i - j`` in [q0 - k0 - (n - 1), q0 - k0 + (n - 1)]; comparing
that interval with [0, window] says whether the block is skipped, computed whole, computed with
the plain causal triangle (the diagonal block) or needs an explicit mask.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch


class Block(enum.Enum):
    SKIP = "skip"  # no query sees any key: not computed, nothing sent for it
    FULL = "full"  # every query sees every key: no mask
    CAUSAL = "causal"  # the diagonal block, key j visible to query i iff j <= i (SDPA's is_causal)
    MASKED = "masked"  # a window edge crosses the block: an explicit mask (``allowed``)


def rank_chunks(rank: int, size: int) -> tuple:
    """The two of the 2·size equal chunks of the sequence that CP rank ``rank`` holds, in the
    order they are concatenated: i and 2·size - 1 - i (Megatron-LM's load balancing for the
    causal mask, DESIGN.md §11)."""
    return rank, 2 * size - 1 - rank


def block_kind(q_start: int, k_start: int, length: int, window: Optional[int] = None) -> Block:
    """How the block of ``length`` queries from position ``q_start`` against ``length`` keys from
    ``k_start`` is computed (``window``: keys before the query a query sees; None: all)."""
    nearest = q_start - k_start - (length - 1)  # the smallest i - j in the block
    farthest = q_start - k_start + (length - 1)  # the largest
    reach = float("inf") if window is None else window
    if farthest < 0 or nearest > reach:
        return Block.SKIP
    if nearest >= 0 and farthest <= reach:
        return Block.FULL
    if q_start == k_start and farthest <= reach:
        return Block.CAUSAL
    return Block.MASKED


def step_blocks(rank: int, size: int, step: int, chunk: int, window: Optional[int] = None) -> list:
    """The blocks ring attention computes on CP rank ``rank`` at ``step`` (when it holds the KV of
    rank ``rank - step``): (query half, key half, kind) for each pair of its two query chunks and
    the two KV chunks that is not skipped. ``chunk``: tokens per chunk."""
    source = (rank - step) % size
    pairs = (
        (x, y, block_kind(q * chunk, k * chunk, chunk, window))
        for x, q in enumerate(rank_chunks(rank, size))
        for y, k in enumerate(rank_chunks(source, size))
    )
    return [(x, y, kind) for x, y, kind in pairs if kind is not Block.SKIP]


def allowed(q_positions: torch.Tensor, k_positions: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """[queries, keys] bool, True where the query sees the key (the dense rule every block obeys)."""
    behind = q_positions[:, None] - k_positions[None, :]
    visible = behind >= 0
    return visible if window is None else visible & (behind <= window)
