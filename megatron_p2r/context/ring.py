"""Ring attention (``--cp-comm-type p2p``, Megatron-LM's default): each rank keeps its queries;
the KV blocks travel around the CP ring, rank r sending to r + 1 with async isend/irecv while
it computes with the block it holds; partial outputs are merged with their log-sum-exp.

At step t rank i holds the KV of rank i - t. Its two query chunks and the two KV chunks make
four blocks; ``blocks.block_kind`` decides per block whether it is computed (and how) or
skipped. With the load-balanced chunks every rank computes the same number of blocks.
The backward passes the KV around the same way, with the fp32 dK/dV accumulated for it one
hop behind: after N hops each rank holds the whole gradient of its own KV.
Attention sinks join the merged log-sum-exp once, after the last block.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_p2r.context.blocks import Block, allowed, rank_chunks, step_blocks
from megatron_p2r.context.kernels import block_backward, block_forward


class _Ring:
    """This rank's neighbours in the CP group, and a pass of one tensor one hop along."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor) -> tuple:
        """Send ``tensor`` to the next rank, receive the previous rank's into a new buffer:
        (the buffer, the works to wait on before reading it)."""
        incoming = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, incoming, self.prev, self.group),
        ]
        return incoming, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: List) -> None:
        for work in works:
            work.wait()


def _blocks(ring: _Ring, step: int, chunk: int, window: Optional[int], device) -> list:
    """``blocks.step_blocks`` with each MASKED block's mask: (query half, key half, kind, mask)."""
    source = (ring.rank - step) % ring.size
    todo = []
    for x, y, kind in step_blocks(ring.rank, ring.size, step, chunk, window):
        visible = None
        if kind is Block.MASKED:
            positions = torch.arange(chunk, device=device)
            q_start, k_start = rank_chunks(ring.rank, ring.size)[x] * chunk, rank_chunks(source, ring.size)[y] * chunk
            visible = allowed(q_start + positions, k_start + positions, window)
        todo.append((x, y, kind, visible))
    return todo


def _merge(acc: Optional[tuple], out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """Two partial softmax results over disjoint keys -> their union's (fp32 out, lse)."""
    out = out.float()
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    merged = torch.logaddexp(acc_lse, lse)
    weight = lambda part: torch.exp(part - merged).unsqueeze(-1)  # noqa: E731
    return acc_out * weight(acc_lse) + out * weight(lse), merged


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, window, dropout_p):
        ring = _Ring(group)
        chunk, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        q_halves = [h.contiguous() for h in q.chunk(2, dim=2)]
        kv = torch.stack([k, v]).contiguous()
        acc, keeps = [None, None], {}
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, works = ring.start(kv)  # the next block travels while this one computes
            for x, y, kind, visible in _blocks(ring, step, chunk, window, q.device):
                k_blk, v_blk = (t[:, :, y * chunk : (y + 1) * chunk].contiguous() for t in kv)
                out, lse, keep = block_forward(q_halves[x], k_blk, v_blk, kind, visible, scale, dropout_p)
                acc[x] = _merge(acc[x], out, lse)
                keeps[step, x, y] = keep
            if step < ring.size - 1:
                ring.wait(works)
                kv = incoming
        out, lse = (torch.cat(parts, dim=2) for parts in zip(*acc, strict=True))
        if sinks is not None:  # the sink: one more term of every denominator, nothing in the numerator
            with_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
            out, lse = out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink
        out = out.to(q.dtype)
        drawn = [key for key, keep in keeps.items() if keep is not None]
        # the dropout masks saved like the rest, so saved-tensor hooks (offloading) see them
        ctx.save_for_backward(q, k, v, out, lse, sinks, *(keeps[key] for key in drawn))
        ctx.ring, ctx.window, ctx.dropout_p, ctx.drawn = ring, window, dropout_p, drawn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks, *masks = ctx.saved_tensors
        keeps = dict(zip(ctx.drawn, masks, strict=True))
        ring, window, dropout_p = ctx.ring, ctx.window, ctx.dropout_p
        chunk, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # rowsum(dO * O) [b, heads, s_local]
        halves = lambda t: [h.contiguous() for h in t.chunk(2, dim=2)]  # noqa: E731
        q_h, go_h, out_h, lse_h, delta_h = (halves(t) for t in (q, grad_out, out, lse, delta))
        dq = [torch.zeros_like(h, dtype=torch.float32) for h in q_h]
        kv = torch.stack([k, v]).contiguous()
        dkv, dkv_works, outgoing = None, [], None
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, works = ring.start(kv)
            mine = torch.zeros_like(kv, dtype=torch.float32)  # this step's share of the held KV's grad
            for x, y, kind, visible in _blocks(ring, step, chunk, window, q.device):
                k_blk, v_blk = (t[:, :, y * chunk : (y + 1) * chunk].contiguous() for t in kv)
                keep = keeps.get((step, x, y))
                args = (out_h[x], lse_h[x], delta_h[x], kind, visible, scale, dropout_p, keep)
                dq_b, dk_b, dv_b = block_backward(go_h[x], q_h[x], k_blk, v_blk, *args)
                dq[x] += dq_b
                mine[0, :, :, y * chunk : (y + 1) * chunk] += dk_b
                mine[1, :, :, y * chunk : (y + 1) * chunk] += dv_b
            ring.wait(dkv_works)  # the earlier ranks' share of the same KV's grad (and our last send done)
            outgoing = mine if dkv is None else dkv + mine
            dkv, dkv_works = ring.start(outgoing)
            if step < ring.size - 1:
                ring.wait(works)
                kv = incoming
        ring.wait(dkv_works)  # after N hops: the whole gradient of this rank's own KV
        grad_sinks = None
        if sinks is not None:  # d loss / d sink = -sum over queries of p(sink) * delta
            grad_sinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)
        dq = torch.cat(dq, dim=2).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), grad_sinks, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    window: Optional[int],
    sink_logits: Optional[torch.Tensor],
    dropout_p: float,
) -> torch.Tensor:
    """``context_parallel_attention`` with ``comm_type="p2p"`` (its arguments, checked there)."""
    return _RingAttention.apply(q, k, v, sink_logits, group, window, dropout_p)
