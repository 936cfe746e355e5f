"""Global optimizer state out of and into a ``MixedPrecisionOptimizer``, for checkpoints.

A checkpoint holds each parameter's fp32 weight (the main parameter, not its 16-bit rounding)
and its optimizer state (``optim.optimizer.OPTIMIZER_KINDS``: AdamW's moments, Lion's one,
Adafactor's statistics, which this module hands out and takes broadcast to the weight's shape,
``adafactor.checkpoint_value``, and the checkpoint stores factored, ``optim/factored_form.py``)
whole, in fp32 whatever dtype they are
stored in (``--exp-avg-dtype``: the upcast is exact, and the loading optimizer rounds them to its
own dtypes), whatever part of them this rank steps: ``gather_state`` returns them (under the
distributed optimizer all-gathered bucket by bucket, in chunks bounded by the DDP staging
buffer, copied to host only on the ranks that write), ``StateLoader`` takes any range of them
and keeps what this rank steps. So a checkpoint never depends on the DP size or on
whether the distributed optimizer, 16-bit parameters or offload were on.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from megatron_p2r.optim.adafactor import Piece, checkpoint_value, take_checkpoint_value, take_second_moment
from megatron_p2r.optim.factored_form import FACTOR_KINDS
from megatron_p2r.optim.mixed_precision import MainShard, MixedPrecisionOptimizer
from megatron_p2r.optim.optimizer import OPTIMIZER_KINDS
from megatron_p2r.parallel.grad_buffer import ParamAndGradBuffer, all_gather_chunks

MOMENTS = ("exp_avg", "exp_avg_sq")  # elementwise state: any range of it is that range's state


def state_kinds(opt: MixedPrecisionOptimizer) -> tuple:
    """The optimizer state entries ``opt`` writes and reads, besides the step count."""
    return tuple(k for k in OPTIMIZER_KINDS[opt.kind] if k != "step")


def _piece(ms: MainShard) -> Piece:
    return Piece(tuple(ms.param.shape), ms.start, ms.end)


def stored_state(opt: MixedPrecisionOptimizer, ms: MainShard, kind: str) -> torch.Tensor:
    """The fp32 main weights ("model") or a state entry of the range ``ms`` this rank steps, as
    the optimizer keeps it (16-bit moments with the precision-aware optimizer)."""
    if kind == "model":
        return ms.main.detach()
    state = opt.inner[ms.placement].state[ms.main]
    return checkpoint_value(state, _piece(ms), kind) if kind in FACTOR_KINDS else state[kind]


def state_value(opt: MixedPrecisionOptimizer, ms: MainShard, kind: str) -> torch.Tensor:
    """``stored_state`` in fp32, the checkpoint's dtype."""
    return stored_state(opt, ms, kind).float()


def gather_state(
    opt: MixedPrecisionOptimizer, keep: Callable[[nn.Parameter], bool]
) -> Dict[int, Dict[str, torch.Tensor]]:
    """Collective over the gradient buffers' groups: {id(param): {"model", state kinds: fp32
    tensors of the parameter's shape}} for every parameter ``keep`` accepts (state only after a
    step)."""
    kinds = ("model",) + (state_kinds(opt) if opt.step_count else ())
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for b, buf in enumerate(opt.ddp.buffers):
            if buf.layout.sharded:
                _gather_sharded(opt, b, buf, kinds, keep, out)
                continue
            for p in buf.params:
                if keep(p):
                    ms = opt.whole_shards[id(p)]
                    out[id(p)] = {kind: state_value(opt, ms, kind).view(p.shape) for kind in kinds}
    return out


def _gather_sharded(opt: MixedPrecisionOptimizer, b: int, buf: ParamAndGradBuffer, kinds, keep, out) -> None:
    layout, members = buf.layout, buf.layout.members
    staging = opt.ddp.staging(torch.float32, buf.staging_numel)
    for i, bucket in enumerate(layout.buckets):
        kept = [j for j in bucket.params if keep(buf.params[j])]
        lo, hi = layout.shard(i, buf.member)
        owned = [ms for ms in opt.shards if ms.buffer == b and ms.bucket == i]
        for kind in kinds:
            shard = torch.zeros(hi - lo, dtype=torch.float32, device=opt.ddp.ps.device)
            for ms in owned:
                shard[ms.position - lo : ms.position - lo + ms.end - ms.start].copy_(
                    state_value(opt, ms, kind).reshape(-1)
                )
            full = torch.empty(bucket.end - bucket.start, dtype=torch.float32) if kept else None
            for start, end, block in all_gather_chunks(shard, members, staging, buf.group):
                if full is not None:
                    full.view(members, -1)[:, start:end].copy_(block)
            for j in kept:
                p, (a, z) = buf.params[j], layout.ranges[j]
                out.setdefault(id(p), {})[kind] = full[a - bucket.start : z - bucket.start].view(p.shape)


class StateLoader:
    """Takes any flat range of a parameter's global state and keeps this rank's part;
    ``finish`` installs it in the optimizer's own state (torch places it and ``step``).
    Adafactor's statistics are taken from whole weights (each rank keeps all of a matrix's);
    with ``adam_beta2`` they are made of AdamW's second moment: its bias-corrected row and column
    means (a vector's: the moment itself), what Adafactor's statistics estimate. ``variance_kind``:
    the statistic holding a vector's variance (``row_var`` in broadcast checkpoints)."""

    def __init__(
        self, opt: MixedPrecisionOptimizer, adam_beta2: Optional[float] = None, variance_kind: str = "col_var"
    ):
        self.opt, self.adam_beta2, self.variance_kind = opt, adam_beta2, variance_kind
        self.moments: Dict[int, Dict[str, torch.Tensor]] = {}
        self.step: Optional[int] = None

    def reads_whole(self, kind: str) -> bool:
        """Whether ``kind`` is read whole weights at a time (Adafactor's statistics, or the AdamW
        moment they are made of), not only the ranges this rank steps."""
        return kind in FACTOR_KINDS or self.adam_beta2 is not None

    def _overlaps(self, p: nn.Parameter, offset: int, n: int):
        for ms in self.opt.shards_of.get(id(p), []):
            lo, hi = max(ms.start, offset), min(ms.end, offset + n)
            if lo < hi:
                yield ms, lo, hi

    def steps_any(self, p: nn.Parameter, offset: int, n: int) -> bool:
        """Whether this rank steps any of the flat elements [offset, offset + n) of ``p``."""
        return any(True for _ in self._overlaps(p, offset, n))

    def put(self, p: nn.Parameter, offset: int, kind: str, value: torch.Tensor) -> None:
        """``value`` holds the flat elements [offset, offset + value.numel()) of ``p``'s ``kind``
        (model or a state kind) or, for ``step``, the steps taken."""
        if kind == "step":
            self.step = int(value.item())
            return
        flat = value.reshape(-1)
        if kind in FACTOR_KINDS:
            for ms in self.opt.shards_of.get(id(p), []):
                take_checkpoint_value(
                    self.moments.setdefault(id(ms.main), {}), _piece(ms), kind, offset, flat, self.variance_kind
                )
            return
        if kind == "exp_avg_sq" and self.adam_beta2 is not None:
            for ms in self.opt.shards_of.get(id(p), []):
                take_second_moment(self.moments.setdefault(id(ms.main), {}), _piece(ms), kind, offset, flat)
            return
        with torch.no_grad():
            if kind == "model":  # every rank holds the whole weight, in its own dtype
                p.data.view(-1)[offset : offset + flat.numel()].copy_(flat)
            for ms, lo, hi in self._overlaps(p, offset, flat.numel()):
                src = flat[lo - offset : hi - offset]
                if kind == "model":
                    if not ms.aliases_param:
                        ms.main.view(-1)[lo - ms.start : hi - ms.start].copy_(src)
                    continue
                kept = self.moments.setdefault(id(ms.main), {})
                if kind not in kept:
                    kept[kind] = torch.zeros(ms.end - ms.start, dtype=torch.float32)
                kept[kind][lo - ms.start : hi - ms.start].copy_(src)

    def finish(self, moments: bool) -> None:
        """Install the state read (when ``moments``) with the step count read."""
        if not moments:
            return
        if self.step is None:
            raise ValueError("optimizer state without a step count")
        if self.adam_beta2 is not None:  # AdamW's bias correction, once the step count is read
            for kept in self.moments.values():
                for value in kept.values():
                    value.div_(1 - self.adam_beta2**self.step)
        for inner in self.opt.inner.values():
            sd = inner.state_dict()
            mains: List[torch.Tensor] = [m for g in inner.param_groups for m in g["params"]]
            sd["state"] = {
                i: {
                    "step": torch.tensor(float(self.step)),
                    **{k: v.view(m.shape) if k in MOMENTS else v for k, v in self.moments[id(m)].items()},
                }
                for i, m in enumerate(mains)
            }
            inner.load_state_dict(sd)
        self.opt.step_count = self.step
