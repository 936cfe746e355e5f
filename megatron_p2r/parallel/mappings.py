"""Autograd-aware collectives for tensor and expert parallelism.

Each function is the identity when its group is None (size 1), so the same model code is
the single-process reference.

    copy_to_region       fwd: identity     bwd: all-reduce    (enter a TP region)
    reduce_from_region   fwd: all-reduce   bwd: identity      (leave a TP region)
    gather_from_region   fwd: all-gather last dim   bwd: split
    all_to_all           fwd: all-to-all with split sizes   bwd: the reverse all-to-all

Sequence parallelism (Megatron's ``*_sequence_parallel_region``) splits dimension 1, the
sequence of our batch-first ``[b, s, ...]`` tensors (docs/parallelism.md says why batch-first):

    gather_from_sequence_region        fwd: all-gather along s   bwd: reduce-scatter along s
    reduce_scatter_to_sequence_region  fwd: reduce-scatter along s   bwd: all-gather along s
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(size, dim=-1)[rank].contiguous(), None


def copy_to_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return x if group is None else _Copy.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return x if group is None else _Reduce.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return x if group is None else _Gather.apply(x, group)


SEQUENCE_DIM = 1


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s/TP, ...]`` shards of the TP ranks -> ``[b, s, ...]`` (rank order along s).
    One collective into a ``[TP x b, s/TP, ...]`` buffer; the reorder is a view when b == 1."""
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (size, -1)).movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, ...]`` partial sums on each TP rank -> this rank's ``[b, s/TP, ...]`` of their sum."""
    size = dist.get_world_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence parallelism: sequence length {x.shape[SEQUENCE_DIM]} not divisible by TP={size}")
    parts = x.unflatten(SEQUENCE_DIM, (size, -1)).movedim(SEQUENCE_DIM, 0).contiguous()
    out = x.new_empty(parts.shape[1:])
    dist.reduce_scatter_single(out, parts.flatten(0, 1), group=group)
    return out


class _SequenceCollective(torch.autograd.Function):
    """``op`` forward, its adjoint ``adjoint`` on the gradient (all-gather <-> reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, op, adjoint):
        ctx.group, ctx.adjoint = group, adjoint
        return op(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g, ctx.group), None, None, None


def gather_from_sequence_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Enter a TP region from a sequence shard; each rank's gradient of the full tensor is partial."""
    return x if group is None else _SequenceCollective.apply(x, group, all_gather_sequence, reduce_scatter_sequence)


def _sequence_shard(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence parallelism: sequence length {x.shape[SEQUENCE_DIM]} not divisible by TP={size}")
    return x.chunk(size, dim=SEQUENCE_DIM)[rank].contiguous()


def scatter_to_sequence_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Leave a TP region whose output every rank holds whole: keep this rank's sequence shard
    (the gradient is all-gathered back)."""
    return x if group is None else _SequenceCollective.apply(x, group, _sequence_shard, all_gather_sequence)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Leave a TP region: sum the ranks' partial outputs, keep this rank's sequence shard."""
    if group is None:
        return x
    return _SequenceCollective.apply(x, group, reduce_scatter_sequence, all_gather_sequence)


def start_all_to_all(
    x: torch.Tensor, out_splits: List[int], in_splits: List[int], group
) -> Tuple[torch.Tensor, Callable[[], None]]:
    """Start the all-to-all of ``x``'s rows (split by ``in_splits``; ``out_splits`` rows come back):
    the output buffer and a ``wait`` that returns once it is filled. Overlapped schedules compute
    while it is in flight (``pipeline/a2a_overlap.py``).

    gloo has no all_to_all, so on CPU it is built from batched isend/irecv (documented in
    docs/parallelism.md); NCCL uses the native collective.
    """
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if dist.get_backend(group) != "gloo":
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        return out, work.wait
    me = dist.get_rank(group)
    ins, outs = x.split(in_splits), out.split(out_splits)
    ops = []
    for peer in range(dist.get_world_size(group)):
        global_peer = dist.get_global_rank(group, peer)
        if peer == me:
            outs[peer].copy_(ins[peer])
            continue
        if in_splits[peer]:
            ops.append(dist.P2POp(dist.isend, ins[peer].contiguous(), global_peer, group))
        if out_splits[peer]:
            ops.append(dist.P2POp(dist.irecv, outs[peer], global_peer, group))
    works = dist.batch_isend_irecv(ops) if ops else []

    def wait() -> None:
        for work in works:
            work.wait()

    return out, wait


def _all_to_all_single(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    out, wait = start_all_to_all(x, out_splits, in_splits, group)
    wait()
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all_single(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all_single(g, in_splits, out_splits, ctx.group), None, None, None


class _StartedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, waits):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out, wait = start_all_to_all(x, out_splits, in_splits, group)
        waits.append(wait)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all_single(g, in_splits, out_splits, ctx.group), None, None, None, None


def started_all_to_all(
    x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: dist.ProcessGroup
) -> Tuple[torch.Tensor, Callable[[], None]]:
    """``all_to_all`` started, not finished: the output (filled only once ``wait()`` returns;
    read nothing of it before) and ``wait``, so that work that does not read it runs while the
    rows are in flight. Its backward is the blocking reverse all-to-all."""
    waits: List[Callable[[], None]] = []
    out = _StartedAllToAll.apply(x, list(out_splits), list(in_splits), group, waits)
    return out, waits[0]


def all_to_all(
    x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 with per-rank row counts."""
    return x if group is None else _AllToAll.apply(x, list(out_splits), list(in_splits), group)
