"""Causal attention whose sequence is split over the ranks of a CP group.

Each CP rank holds chunks i and 2N-1-i of the 2N equal chunks of the sequence (``blocks.rank_chunks``)
for its queries, keys and values; ``context_parallel_attention`` returns what the one-process
core (``model.attention.Attention.core``) returns for those queries over the whole sequence:
the same sliding window, attention sinks, GQA and dropout. Three ways to see the other ranks'
keys (``--cp-comm-type``, docs/context_parallel_attention.md):

    p2p        ring attention (``context.ring``): KV blocks passed around the ring, overlapped
    allgather  KV gathered once (its gradient reduce-scattered); attention over the whole sequence
    a2a        DeepSpeed-Ulysses: heads scattered, sequence gathered, one-process attention, back
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_p2r.context.blocks import allowed, rank_chunks
from megatron_p2r.context.chunks import chunk_positions
from megatron_p2r.context.ring import ring_attention
from megatron_p2r.parallel.mappings import all_to_all, gather_from_sequence_region

COMM_TYPES = ("p2p", "allgather", "a2a")
REFUSED = {"a2a+p2p": "hierarchical a2a+p2p is not implemented; use p2p, a2a or allgather"}


def check_comm_type(comm_type: str) -> None:
    """Raise ValueError naming the flag for a comm type that is not built."""
    if comm_type in REFUSED:
        raise ValueError(f"--cp-comm-type {comm_type}: {REFUSED[comm_type]}")
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type}: expected one of {', '.join(COMM_TYPES)}")


def sdpa_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: Optional[torch.Tensor],
    sink_logits: Optional[torch.Tensor],
    dropout_p: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA of q over k, v where ``visible`` [queries, keys] says which keys each query sees (None:
    the causal triangle, is_causal). ``sink_logits`` [heads]: one more key per head, value 0, logit
    the head's sink, so exp(sink) joins every softmax denominator (Megatron-LM's softmax offsets)."""
    if sink_logits is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, dropout_p=dropout_p, is_causal=visible is None, enable_gqa=enable_gqa
        )
    if visible is None:
        visible = allowed(torch.arange(q.shape[2], device=q.device), torch.arange(k.shape[2], device=q.device))
    zeros = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    heads, queries, keys = q.shape[1], visible.shape[0], visible.shape[1]
    blocked = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    sink = sink_logits.to(q.dtype).view(heads, 1, 1).expand(heads, queries, 1)
    mask = torch.cat([blocked.expand(heads, queries, keys), sink], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa)


def _allgather_attention(q, k, v, group, window, sink_logits, dropout_p, enable_gqa):
    """KV of every rank gathered along the sequence (the backward reduce-scatters dK, dV) and put
    in sequence order; each query chunk then attends only to the keys up to its end (and from its
    window's start), so no rank computes the blocks above the diagonal."""
    size, rank, local = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
    kv = torch.cat([k, v], dim=-1).transpose(1, 2)  # [b, s_local, kv heads, 2d]: one collective
    kv = gather_from_sequence_region(kv, group).transpose(1, 2)
    order = torch.argsort(torch.cat([chunk_positions(local * size, size, r, q.device) for r in range(size)]))
    k_all, v_all = kv.index_select(2, order).split(k.shape[-1], dim=-1)
    chunk, outs = local // 2, []
    for c, q_chunk in zip(rank_chunks(rank, size), q.chunk(2, dim=2), strict=True):
        start, end = 0 if window is None else max(0, c * chunk - window), (c + 1) * chunk
        positions = torch.arange(end, device=q.device)
        visible = allowed(positions[c * chunk :], positions[start:], window)
        keys, values = k_all[:, :, start:end], v_all[:, :, start:end]
        outs.append(sdpa_with_sinks(q_chunk, keys, values, visible, sink_logits, dropout_p, enable_gqa))
    return torch.cat(outs, dim=2)


def _heads_to_sequence(x: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """[b, heads, s_local, d] -> [b, heads/N, s, d] in sequence order (``order``: the gathered
    tokens' permutation into it): each rank keeps one group of heads over the whole sequence."""
    size = dist.get_world_size(group)
    b, heads, local, d = x.shape
    rows = x.reshape(b, size, heads // size, local, d).transpose(0, 1).reshape(size * b, heads // size, local, d)
    out = all_to_all(rows, [b] * size, [b] * size, group)  # row block r: rank r's tokens
    out = out.reshape(size, b, heads // size, local, d).permute(1, 2, 0, 3, 4).reshape(b, heads // size, -1, d)
    return out.index_select(2, order)


def _sequence_to_heads(x: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_heads_to_sequence``: [b, heads/N, s, d] -> [b, heads, s_local, d]."""
    size = dist.get_world_size(group)
    b, part, s, d = x.shape
    local = s // size
    x = x.index_select(2, torch.argsort(order))  # back to rank order
    rows = x.reshape(b, part, size, local, d).permute(2, 0, 1, 3, 4).reshape(size * b, part, local, d)
    out = all_to_all(rows, [b] * size, [b] * size, group)  # row block r: rank r's heads
    return out.reshape(size, b, part, local, d).transpose(0, 1).reshape(b, size * part, local, d)


def _a2a_attention(q, k, v, group, window, sink_logits, dropout_p, enable_gqa):
    """DeepSpeed-Ulysses: after the all-to-all each rank runs the one-process attention for
    heads/N heads (and kv heads/N KV heads) over the whole sequence, in sequence order."""
    size, rank, local = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
    if q.shape[1] % size or k.shape[1] % size:
        raise ValueError(
            f"--cp-comm-type a2a: {q.shape[1]} local attention heads and {k.shape[1]} local key/value heads "
            f"must both be divisible by the context-parallel size {size}; use p2p or allgather"
        )
    order = torch.argsort(torch.cat([chunk_positions(local * size, size, r, q.device) for r in range(size)]))
    q_s, k_s, v_s = (_heads_to_sequence(t, group, order) for t in (q, k, v))
    visible = None
    if window is not None:
        positions = torch.arange(q_s.shape[2], device=q.device)
        visible = allowed(positions, positions, window)
    if sink_logits is not None:
        sink_logits = sink_logits.chunk(size)[rank]
    y = sdpa_with_sinks(q_s, k_s, v_s, visible, sink_logits, dropout_p, enable_gqa)
    return _sequence_to_heads(y, group, order)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup],
    comm_type: str,
    window: Optional[int] = None,
    sink_logits: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    q [b, heads, s_local, d], k and v [b, kv heads, s_local, d]: this rank's two chunks
    (``blocks.rank_chunks``) concatenated. ``window``: keys before the query it sees (None: all);
    ``sink_logits`` [heads]: the heads' softmax offsets (None: vanilla softmax). Returns
    [b, heads, s_local, d]. Dropout draws from the caller's RNG state (each rank its own masks).
    """
    check_comm_type(comm_type)
    if q.shape[2] % 2:
        raise ValueError(f"context parallelism: {q.shape[2]} local tokens are not this rank's two equal chunks")
    if group is None or dist.get_world_size(group) == 1:
        positions = torch.arange(q.shape[2], device=q.device)
        visible = None if window is None else allowed(positions, positions, window)
        return sdpa_with_sinks(q, k, v, visible, sink_logits, dropout_p, enable_gqa)
    if comm_type == "allgather":
        return _allgather_attention(q, k, v, group, window, sink_logits, dropout_p, enable_gqa)
    if comm_type == "a2a":
        return _a2a_attention(q, k, v, group, window, sink_logits, dropout_p, enable_gqa)
    return ring_attention(q, k, v, group, window, sink_logits, dropout_p)
