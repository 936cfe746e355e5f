"""Process groups and rank arithmetic, nothing else.

Rank order, fastest-varying first: TP, DP, PP — ``rank = tp + TP*(dp + DP*pp)`` — so TP peers
are neighbours (same node) and pipeline stages are far apart. EP divides DP:
``ep_rank = dp % EP`` and ``expert_dp_rank = dp // EP``.

``Layout`` is pure arithmetic (a 512-rank layout is computed in microseconds, no processes);
``ParallelState`` adds the ``torch.distributed`` groups a rank belongs to. Modules receive a
``ParallelState`` explicitly, and ``ParallelState.single()`` is the one-process reference.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

GROUP_KINDS = ("tp", "dp", "pp", "ep", "expert_dp", "embedding", "model_parallel", "pp_dp")


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp, self.ep) < 1 or self.dp % self.ep:
            raise ValueError(f"invalid layout {self}: sizes must be >= 1 and EP must divide DP")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1) -> "Layout":
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by TP*PP = {tp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), ep=ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        dp, pp = rest % self.dp, rest // self.dp
        return Coords(tp=tp, dp=dp, pp=pp, ep=dp % self.ep, expert_dp=dp // self.ep)

    def groups(self, kind: str) -> List[List[int]]:
        """Every group of ``kind`` as sorted rank lists (disjoint; embedding groups may be absent)."""
        T, D, P, E = self.tp, self.dp, self.pp, self.ep
        r = self.rank
        if kind == "tp":
            return [[r(t, d, p) for t in range(T)] for p in range(P) for d in range(D)]
        if kind == "dp":
            return [[r(t, d, p) for d in range(D)] for p in range(P) for t in range(T)]
        if kind == "pp":
            return [[r(t, d, p) for p in range(P)] for d in range(D) for t in range(T)]
        if kind == "ep":
            return [[r(t, x * E + e, p) for e in range(E)]
                    for p in range(P) for x in range(D // E) for t in range(T)]
        if kind == "expert_dp":
            return [[r(t, x * E + e, p) for x in range(D // E)]
                    for p in range(P) for e in range(E) for t in range(T)]
        if kind == "embedding":
            stages = sorted({0, P - 1})
            return [[r(t, d, p) for p in stages] for d in range(D) for t in range(T)]
        if kind == "model_parallel":
            return [sorted(r(t, d, p) for p in range(P) for t in range(T)) for d in range(D)]
        if kind == "pp_dp":
            return [sorted(r(t, d, p) for p in range(P) for d in range(D)) for t in range(T)]
        raise ValueError(f"unknown group kind {kind!r}; known: {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> List[int]:
        for ranks in self.groups(kind):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is in no {kind} group")


@dataclass
class ParallelState:
    """This rank's place in the layout plus its process groups (None where size is 1)."""

    layout: Layout
    rank: int = 0
    groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _subgroups: Dict[tuple, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelState":
        return cls(layout=Layout(), rank=0, device=torch.device(device))

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    # Sizes and ranks in the vocabulary megatron-core users know.
    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)
    ep_size = property(lambda self: self.layout.ep)
    expert_dp_size = property(lambda self: self.layout.expert_dp)
    tp_rank = property(lambda self: self.coords.tp)
    pp_rank = property(lambda self: self.coords.pp)
    dp_rank = property(lambda self: self.coords.dp)
    ep_rank = property(lambda self: self.coords.ep)
    expert_dp_rank = property(lambda self: self.coords.expert_dp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        return self.groups.get(kind)

    def peer(self, pp_rank: int) -> int:
        """Global rank of the stage ``pp_rank`` with this rank's tp and dp coordinates."""
        c = self.coords
        return self.layout.rank(c.tp, c.dp, pp_rank)

    def stage_subgroup(self, stages, over: str = "dp") -> Optional[dist.ProcessGroup]:
        """Group of the pipeline ``stages`` x this rank's ``over`` group (dp or expert_dp),
        at this rank's tp (and ep) coordinates; created by ``initialize``."""
        return self._subgroups[(tuple(sorted(stages)), over)]


def stage_set_groups(layout: Layout, stages, over: str) -> List[List[int]]:
    """All groups "pipeline stages ``stages`` x ``over`` (dp | expert_dp)" of ``layout``."""
    T, D, E = layout.tp, layout.dp, layout.ep
    if over == "dp":
        dps = [list(range(D))]
    elif over == "expert_dp":
        dps = [[x * E + e for x in range(D // E)] for e in range(E)]
    else:
        raise ValueError(f"unknown reduction {over!r}")
    return [sorted(layout.rank(t, d, p) for p in stages for d in members) for members in dps for t in range(T)]


def initialize(layout: Layout, device: torch.device, stage_sets: tuple = (),
               timeout: Optional[datetime.timedelta] = None) -> ParallelState:
    """Create every group of ``layout`` (collectively, in the same order on all ranks).

    ``stage_sets`` lists the sets of pipeline stages that hold replicas of one tensor (the tied
    embedding's first and last stage, the stages sharing a pseudo-phase slot); each becomes
    groups "those stages x dp" and "those stages x expert-dp" (see ``parallel/grads.py``).
    ``timeout`` bounds every collective of the groups (torch gives new groups 30 minutes, not
    the world group's timeout).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_distributed() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the job has {world}")
    state = ParallelState(layout=layout, rank=rank, device=device)
    for kind in GROUP_KINDS:
        for ranks in layout.groups(kind):
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                state.groups[kind] = group
    for stages in sorted({tuple(sorted(s)) for s in stage_sets if len(set(s)) > 1}):
        for over in ("dp", "expert_dp"):
            for ranks in stage_set_groups(layout, stages, over):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    state._subgroups[(stages, over)] = group
    return state
