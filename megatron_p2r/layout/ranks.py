"""Rank arithmetic of a layout: pure functions of the sizes, no processes.

Rank order, fastest-varying first: TP, DP, PP — ``rank = tp + TP*(dp + DP*pp)`` — so TP peers
are neighbours (same node) and pipeline stages are far apart. EP divides DP:
``ep_rank = dp % EP`` and ``expert_dp_rank = dp // EP``. A 512-rank layout is computed in
microseconds, which is what lets the planner and the tests reason about any rank in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

# The groups every rank joins; replicated tensors reduce over the stage-set groups below.
GROUP_KINDS = ("tp", "dp", "pp", "ep", "expert_dp")


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
        """Every group of ``kind`` as sorted rank lists (disjoint, together the whole world)."""
        T, D, P, E = self.tp, self.dp, self.pp, self.ep
        r = self.rank
        if kind == "tp":
            return [[r(t, d, p) for t in range(T)] for p in range(P) for d in range(D)]
        if kind == "dp":
            return [[r(t, d, p) for d in range(D)] for p in range(P) for t in range(T)]
        if kind == "pp":
            return [[r(t, d, p) for p in range(P)] for d in range(D) for t in range(T)]
        if kind == "ep":
            return [[r(t, x * E + e, p) for e in range(E)] for p in range(P) for x in range(D // E) for t in range(T)]
        if kind == "expert_dp":
            return [[r(t, x * E + e, p) for x in range(D // E)] for p in range(P) for e in range(E) for t in range(T)]
        raise ValueError(f"unknown group kind {kind!r}; known: {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The group of ``kind`` holding ``rank``: the member of ``groups(kind)``, computed from
        the rank's coordinates (the planner asks for it per stage of a 3,072-rank layout)."""
        c, r, E = self.coords(rank), self.rank, self.ep
        if kind == "tp":
            return [r(t, c.dp, c.pp) for t in range(self.tp)]
        if kind == "dp":
            return [r(c.tp, d, c.pp) for d in range(self.dp)]
        if kind == "pp":
            return [r(c.tp, c.dp, p) for p in range(self.pp)]
        if kind == "ep":
            return [r(c.tp, c.expert_dp * E + e, c.pp) for e in range(E)]
        if kind == "expert_dp":
            return [r(c.tp, x * E + c.ep, c.pp) for x in range(self.expert_dp)]
        raise ValueError(f"unknown group kind {kind!r}; known: {GROUP_KINDS}")


def stage_set_groups(layout: Layout, stages, over: str, tp_block: int = 1) -> List[List[int]]:
    """All groups "``tp_block`` consecutive TP ranks x pipeline stages ``stages`` x ``over``
    (dp | expert_dp)" of ``layout``."""
    T, D, E = layout.tp, layout.dp, layout.ep
    if over == "dp":
        dps = [list(range(D))]
    elif over == "expert_dp":
        dps = [[x * E + e for x in range(D // E)] for e in range(E)]
    else:
        raise ValueError(f"unknown reduction {over!r}")
    blocks = [range(b, b + tp_block) for b in range(0, T, tp_block)]
    return [
        sorted(layout.rank(t, d, p) for p in stages for d in members for t in block)
        for members in dps
        for block in blocks
    ]
