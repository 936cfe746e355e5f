"""Which tokens of a sequence a context-parallel rank holds: pure functions, no processes.

The sequence is cut into 2N equal chunks (N = CP size) and CP rank i holds chunks i and
2N-1-i, in that order (Megatron-LM's ``get_batch_on_this_cp_rank``). Under the causal mask a
query at position p attends to p+1 keys, so an early chunk is cheap and a late one dear; pairing
chunk i with its mirror gives every rank the same attention work, which a contiguous split
(rank i holding the i-th N-th) does not: its last rank would do 2N-1 times the work of its first.
"""

from __future__ import annotations

from typing import Dict

import torch

# The [b, s] tensors of a micro-batch that are split along the sequence (position 1).
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask")


def chunk_size(seq_length: int, cp_size: int) -> int:
    """Tokens per chunk: the sequence over 2 x CP (it must divide: Megatron-LM's rule)."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_length} tokens does not split into 2 x {cp_size} equal chunks")
    return seq_length // (2 * cp_size)


def chunk_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions CP rank ``cp_rank`` holds, in its order: chunk i, then chunk 2N-1-i."""
    c = chunk_size(seq_length, cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def split_sequence(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (the sequence), concatenated."""
    if cp_size == 1:
        return t
    c = chunk_size(t.shape[dim], cp_size)
    chunks = t.split(c, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def split_batch(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int) -> Dict[str, torch.Tensor]:
    """A micro-batch of whole sequences (``[b, s]`` tokens, labels, loss mask) as CP rank
    ``cp_rank`` reads it: its chunks of each, the loss mask kept token by token, so the
    rank's masked sum is its share of the sequence's."""
    return {k: split_sequence(v, cp_size, cp_rank) if k in SEQUENCE_KEYS else v for k, v in batch.items()}
