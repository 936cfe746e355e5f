"""Gradient buffers, their buckets and the distributed optimizer's shards, as pure layout.

megatron-core's ``_ParamAndGradBuffer`` semantics without tensors, so that the ParallelPlan
holds the answer and the runtime (``parallel/ddp.py``), the optimizer, the checkpoint writer
and the planner all read the same one:

- a stage has one buffer per reduction group (DP, expert-DP, or a cross-stage group "stages S x
  DP" of tied embeddings and pseudo slots); parameters are laid out in reverse order (the order
  backward makes their gradients final), each a contiguous range;
- the buffer is cut into buckets of about ``--ddp-bucket-size`` elements (a parameter never
  straddles two buckets); with offload configured a bucket also never spans two layer modules,
  so each bucket lives wholly on the device or wholly on host on every rank of its group;
- with the distributed optimizer each bucket is padded to a multiple of lcm(members, 128) and
  member j of the group owns the j-th of its ``members`` equal slices (its shard), each
  parameter start is aligned to 64 elements (Megatron-LM's padding); a parameter may thus
  straddle several members' shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

PARAM_ALIGN = 64  # elements; a parameter's start under the distributed optimizer
BUCKET_ALIGN = 128  # a sharded bucket's size is a multiple of lcm(members, BUCKET_ALIGN)
BUCKET_FLOOR, BUCKET_PER_DP = 40_000_000, 1_000_000  # Megatron's default bucket size


def default_bucket_size(dp: int, overlap_grad_reduce: bool, requested: Optional[int]) -> Optional[int]:
    """Megatron-LM's rule: ``requested`` or max(4e7, 1e6 x DP) elements when reductions overlap
    backward; without overlap one bucket per buffer (None)."""
    if not overlap_grad_reduce:
        return None
    return requested or max(BUCKET_FLOOR, BUCKET_PER_DP * dp)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    start: int  # [start, end) in the buffer, padding included
    end: int
    params: Tuple[int, ...]  # positions (in the buffer's order) of its parameters


@dataclass(frozen=True)
class GradBuffer:
    """One reduction group's buffer on one stage."""

    over: str  # dp | expert_dp
    stages: Tuple[int, ...]  # the cross-stage group's stages (empty: this stage alone)
    tp_block: int  # consecutive TP ranks summing partial gradients (1: none)
    members: int  # ranks the gradients are reduced over
    sharded: bool  # distributed optimizer: each member steps its shard only
    names: Tuple[str, ...]  # module paths, in buffer order
    modules: Tuple[Optional[int], ...]  # the layer module (key K of ``layers.K.``) of each, or None
    ranges: Tuple[Tuple[int, int], ...]
    buckets: Tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    def bucket_of(self, index: int) -> int:
        return next(b for b, bucket in enumerate(self.buckets) if index in bucket.params)

    def shard(self, bucket: int, member: int) -> Tuple[int, int]:
        """[start, end) of ``member``'s shard of ``bucket`` (the whole bucket when not sharded)."""
        b = self.buckets[bucket]
        if not self.sharded:
            return b.start, b.end
        size = (b.end - b.start) // self.members
        return b.start + member * size, b.start + (member + 1) * size

    def param_shards(self, index: int) -> List[Tuple[int, int, int]]:
        """(member, start, end) of each shard of parameter ``index`` a member owns, in
        parameter-local flat coordinates (every member owns it whole when not sharded)."""
        lo, hi = self.ranges[index]
        if not self.sharded:
            return [(m, 0, hi - lo) for m in range(self.members)]
        bucket = self.bucket_of(index)
        out = []
        for m in range(self.members):
            s, e = self.shard(bucket, m)
            if max(lo, s) < min(hi, e):
                out.append((m, max(lo, s) - lo, min(hi, e) - lo))
        return out

    def owned(self, member: int) -> List[Tuple[int, int, int]]:
        """(parameter index, start, end) of every shard ``member`` owns (at most one per
        parameter: a shard is one range of one bucket), in buffer order."""
        out = []
        for b, bucket in enumerate(self.buckets):
            s, e = self.shard(b, member)
            for i in bucket.params:
                lo, hi = self.ranges[i]
                if max(lo, s) < min(hi, e):
                    out.append((i, max(lo, s) - lo, min(hi, e) - lo))
        return out

    def footprints(self) -> List[int]:
        """Elements of the buffer each parameter accounts for: its own, and the padding up to the
        next parameter or the end of its bucket (they add up to ``numel``)."""
        out = [0] * len(self.names)
        for bucket in self.buckets:
            starts = [self.ranges[i][0] for i in bucket.params] + [bucket.end]
            for k, i in enumerate(bucket.params):
                out[i] = starts[k + 1] - starts[k]
        return out


def layout_buffer(
    over: str,
    stages: Tuple[int, ...],
    tp_block: int,
    members: int,
    sharded: bool,
    names: Sequence[str],
    numels: Sequence[int],
    modules: Sequence[Optional[int]],
    bucket_size: Optional[int],
    break_at_modules: bool,
) -> GradBuffer:
    """Lay ``names`` (already in buffer order) out in buckets; see the module docstring."""
    ranges: List[Tuple[int, int]] = []
    buckets: List[Bucket] = []
    current: List[int] = []
    cursor = start = 0
    for i, n in enumerate(numels):
        if current and break_at_modules and modules[i] != modules[current[-1]]:
            cursor = _close(buckets, start, cursor, current, members, sharded)
            start, current = cursor, []
        if sharded:
            cursor = _round_up(cursor, PARAM_ALIGN)
        ranges.append((cursor, cursor + n))
        current.append(i)
        cursor += n
        if bucket_size is not None and cursor - start >= bucket_size:
            cursor = _close(buckets, start, cursor, current, members, sharded)
            start, current = cursor, []
    if current:
        _close(buckets, start, cursor, current, members, sharded)
    return GradBuffer(
        over=over,
        stages=tuple(stages),
        tp_block=tp_block,
        members=members,
        sharded=sharded,
        names=tuple(names),
        modules=tuple(modules),
        ranges=tuple(ranges),
        buckets=tuple(buckets),
    )


def _close(buckets: List[Bucket], start: int, cursor: int, params: List[int], members: int, sharded: bool) -> int:
    """Append the bucket [start, cursor) (padded when sharded); returns where the next one starts."""
    end = _round_up(cursor, math.lcm(members, BUCKET_ALIGN)) if sharded else cursor
    buckets.append(Bucket(start=start, end=end, params=tuple(params)))
    return end
