"""The tensors of one gradient buffer (megatron-core's ``_ParamAndGradBuffer``): the gradients
(fp32, or bf16 with ``--main-grads-dtype bf16``: they accumulate and are reduced in that dtype) that every parameter of a reduction group accumulates into (``param.main_grad`` is a view), and
under the distributed optimizer the parameters' own storage, both laid out as the plan's
``GradBuffer`` says (``layout/buckets.py``).

Each bucket is stored where its parameters live — on the device, or on host for offloaded
layers — and buckets of one location are contiguous in one tensor. A bucket is reduced with one
collective over its group: all-reduce, or reduce-scatter into this member's shard under the
distributed optimizer; updated weights come back with an all-gather of the shards. A *staged*
bucket (on host while the collectives need device tensors, or one whose group members may keep
it in different places) goes through a bounded device staging buffer, chunk by chunk, in the same
chunks on every member, never the whole buffer at once.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_p2r.layout.buckets import GradBuffer

STAGING_NUMEL = 1 << 24  # elements of the device staging buffer (64 MiB of fp32)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # the dtype flags' names
# reduce_scatter_tensor / all_gather_into_tensor: the names every torch >= 2.4 (setup.py) has
# (recent torch prefers the *_single aliases and warns once per call site).


def grad_range(p: nn.Parameter, start: int, end: int) -> torch.Tensor:
    """The flat range [start, end) of ``p.main_grad`` as it is bound now (a swapped bucket rebinds
    it: ``BucketState.swap_grads``)."""
    return p.main_grad if start == 0 and end == p.numel() else p.main_grad.view(-1)[start:end]


class BucketState:
    """One bucket on this rank: its views, the parameters whose gradients it still waits for,
    and its collective in flight."""

    def __init__(
        self,
        index: int,
        buffer: "ParamAndGradBuffer",
        params: List[nn.Parameter],
        grad: torch.Tensor,
        param: Optional[torch.Tensor],
        staged: bool,
    ):
        self.index, self.buffer, self.params = index, buffer, params
        self.grad, self.param, self.staged = grad, param, staged
        self.second_grad: Optional[torch.Tensor] = None  # --cpu-offload-delayed-param-update: see swap_grads
        self.pending: set = set()
        self.grad_handle = self.param_handle = None
        self.started = self.reduced = False
        self.lock = threading.Lock()  # the overlapped host step may finish the reduction on its thread

    def add_second_grad(self) -> None:
        """A second gradient tensor of the bucket's size and place: the delayed host step reads one
        while the next iteration accumulates into the other (``swap_grads``)."""
        second = torch.zeros_like(self.grad)
        self.second_grad = (
            second.pin_memory() if second.device.type == "cpu" and self.buffer.device.type == "cuda" else second
        )

    def swap_grads(self) -> None:
        """The parameters' ``main_grad`` (and the collectives) move to the other gradient tensor."""
        self.grad, self.second_grad = self.second_grad, self.grad
        self.buffer.bind_main_grads(self)

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This member's shard of ``tensor`` (a view of the bucket)."""
        b = self.buffer.layout.buckets[self.index]
        lo, hi = self.buffer.layout.shard(self.index, self.buffer.member)
        return tensor[lo - b.start : hi - b.start]


class ParamAndGradBuffer:
    """The tensors of ``layout`` on this rank; ``params`` are the model's parameters in layout order."""

    def __init__(
        self,
        layout: GradBuffer,
        params: List[nn.Parameter],
        *,
        member: int,
        group: Optional[dist.ProcessGroup],
        divisor: int,
        device: torch.device,
        staged_everywhere: bool,
        staging: Callable[[torch.dtype, int], torch.Tensor],
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.layout, self.member, self.group, self.divisor, self.device = layout, member, group, divisor, device
        self.params, self.staging = params, staging
        for name, p, (lo, hi) in zip(layout.names, params, layout.ranges, strict=True):
            if p.numel() != hi - lo:
                raise ValueError(f"{name}: the plan's gradient buffer holds {hi - lo} elements, the model {p.numel()}")
        locations = [self._location(b.params) for b in layout.buckets]
        offsets, sizes = [], {}
        for b, where in zip(layout.buckets, locations, strict=True):
            offsets.append(sizes.get(where, 0))
            sizes[where] = offsets[-1] + b.end - b.start
        self.grad_data = self._allocate(sizes, grad_dtype)
        self.param_data = self._allocate(sizes, params[0].dtype) if layout.sharded else None
        self.buckets: List[BucketState] = []
        for i, (b, where, offset) in enumerate(zip(layout.buckets, locations, offsets, strict=True)):
            grad = self.grad_data[where][offset : offset + b.end - b.start]
            param = self.param_data[where][offset : offset + b.end - b.start] if self.param_data else None
            staged = group is not None and (where != device or staged_everywhere)
            self.buckets.append(BucketState(i, self, [params[j] for j in b.params], grad, param, staged))
        largest = max(b.end - b.start for b in layout.buckets)
        # a function of the layout alone, so every member of the group chunks a bucket alike
        self.staging_numel = min(STAGING_NUMEL, largest + largest // layout.members)
        self._bind_params()

    def _location(self, indices) -> torch.device:
        where = {self.params[j].device for j in indices}
        if len(where) != 1:
            raise ValueError(
                f"a gradient bucket of {self.layout.over} spans devices {sorted(map(str, where))}: "
                "buckets break at layer modules only when offload is configured"
            )
        return where.pop()

    def _allocate(self, sizes: Dict[torch.device, int], dtype: torch.dtype) -> Dict[torch.device, torch.Tensor]:
        """One zeroed tensor per location, holding that location's buckets back to back."""
        out = {}
        for where, n in sizes.items():
            t = torch.zeros(n, dtype=dtype, device=where)
            out[where] = t.pin_memory() if where.type == "cpu" and self.device.type == "cuda" else t
        return out

    def bind_main_grads(self, bucket: BucketState) -> None:
        """Each parameter of ``bucket`` gets its ``main_grad`` view of ``bucket.grad``."""
        start = self.layout.buckets[bucket.index].start
        for j in self.layout.buckets[bucket.index].params:
            p, (lo, hi) = self.params[j], self.layout.ranges[j]
            p.main_grad = bucket.grad[lo - start : hi - start].view(p.shape)

    def _bind_params(self) -> None:
        """``main_grad`` views; under the distributed optimizer the parameters move into ``param_data``."""
        with torch.no_grad():
            for bucket in self.buckets:
                self.bind_main_grads(bucket)
                start = self.layout.buckets[bucket.index].start
                for j in self.layout.buckets[bucket.index].params:
                    p, (lo, hi) = self.params[j], self.layout.ranges[j]
                    if bucket.param is not None:
                        view = bucket.param[lo - start : hi - start].view(p.shape)
                        view.copy_(p.data)
                        p.data = view

    # -- gradients
    def zero(self, keep: set = frozenset()) -> None:
        """Zero the buckets' gradients (the tensor each accumulates into now: the other of a
        swapped bucket may still be read), or in a bucket with parameters in ``keep`` every
        gradient but those (padding is never written, so it stays zero)."""
        for bucket in self.buckets:
            if any(id(p) in keep for p in bucket.params):
                for p in bucket.params:
                    if id(p) not in keep:
                        p.main_grad.zero_()
            else:
                bucket.grad.zero_()
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.started = bucket.reduced = False

    def start_grad_reduce(self, bucket: BucketState, async_op: bool) -> None:
        """Sum the bucket over the group (into this member's shard when sharded)."""
        bucket.started = True
        if self.group is None:
            return
        if bucket.staged:
            staging = self.staging(bucket.grad.dtype, self.staging_numel)
            if self.layout.sharded:
                staged_reduce_scatter(bucket.grad, bucket.shard(bucket.grad), self.layout.members, staging, self.group)
            else:
                staged_all_reduce(bucket.grad, staging, self.group)
        elif self.layout.sharded:
            bucket.grad_handle = dist.reduce_scatter_tensor(
                bucket.shard(bucket.grad), bucket.grad, group=self.group, async_op=async_op
            )
        else:
            bucket.grad_handle = dist.all_reduce(bucket.grad, group=self.group, async_op=async_op)

    def finish_grad_reduce(self, bucket: BucketState) -> None:
        """Wait for the bucket's collective and turn the sum into the DP mean (of the shard only,
        when sharded: the rest of the bucket holds local partial sums). Once per step, from
        whichever thread asks first."""
        with bucket.lock:
            if bucket.reduced:
                return
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
                bucket.grad_handle = None
            if self.divisor != 1:
                (bucket.shard(bucket.grad) if self.layout.sharded else bucket.grad).div_(self.divisor)
            bucket.reduced = True

    # -- parameters (distributed optimizer)
    def start_param_gather(self, bucket: BucketState, async_op: bool) -> None:
        """Every member's updated shard of the bucket's parameters to every member."""
        if bucket.param is None:
            return
        if bucket.staged:
            staging = self.staging(bucket.param.dtype, self.staging_numel)
            staged_all_gather(bucket.param, self.member, self.layout.members, staging, self.group)
        else:
            bucket.param_handle = dist.all_gather_into_tensor(
                bucket.param, bucket.shard(bucket.param), group=self.group, async_op=async_op
            )

    def finish_param_gather(self, bucket: BucketState) -> None:
        if bucket.param_handle is not None:
            bucket.param_handle.wait()
            bucket.param_handle = None


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def staged_all_reduce(data: torch.Tensor, staging: torch.Tensor, group) -> None:
    """All-reduce ``data`` (anywhere) through ``staging`` (on the collective's device), in chunks of
    ``staging``'s size: every member issues the same number of collectives."""
    for lo, hi in _chunks(data.numel(), staging.numel()):
        part = staging[: hi - lo]
        part.copy_(data[lo:hi])
        dist.all_reduce(part, group=group)
        data[lo:hi].copy_(part)


def staged_reduce_scatter(data: torch.Tensor, shard: torch.Tensor, members: int, staging: torch.Tensor, group) -> None:
    """Reduce-scatter ``data`` into ``shard`` through ``staging``: column chunks of the [members,
    shard] view, so each collective moves members x chunk elements (and its output one chunk)."""
    rows = data.view(members, -1)
    width = max(staging.numel() // (members + 1), 1)
    for lo, hi in _chunks(rows.shape[1], width):
        n = hi - lo
        block, out = staging[: members * n].view(members, n), staging[members * n : (members + 1) * n]
        block.copy_(rows[:, lo:hi])
        dist.reduce_scatter_tensor(out, block.reshape(-1), group=group)
        shard[lo:hi].copy_(out)


def all_gather_chunks(shard: torch.Tensor, members: int, staging: torch.Tensor, group):
    """Yield (start, end, block): ``block[m]`` is member m's ``shard[start:end]``, gathered through
    ``staging`` in column chunks, so the memory it needs is bounded by ``staging``."""
    width = max(staging.numel() // (members + 1), 1)
    for lo, hi in _chunks(shard.numel(), width):
        n = hi - lo
        block, mine = staging[: members * n].view(members, n), staging[members * n : (members + 1) * n]
        mine.copy_(shard[lo:hi])
        dist.all_gather_into_tensor(block.reshape(-1), mine, group=group)
        yield lo, hi, block


def staged_all_gather(data: torch.Tensor, member: int, members: int, staging: torch.Tensor, group) -> None:
    """All-gather the members' shards of ``data`` (anywhere) through ``staging``."""
    rows = data.view(members, -1)
    for lo, hi, block in all_gather_chunks(rows[member], members, staging, group):
        rows[:, lo:hi].copy_(block)
