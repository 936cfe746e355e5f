"""Rank arithmetic of a layout: pure functions of the sizes, no processes.

Rank order, fastest-varying first: TP, CP, DP, PP (Megatron-LM's ``tp-cp-ep-dp-pp``) —
``rank = tp + TP*(cp + CP*(dp + DP*pp))`` — so TP peers are neighbours (same node), the context-
parallel ranks of a sequence next, and pipeline stages far apart. A parameter's data-parallel
replicas are the DP x CP ranks (every CP rank holds the whole model and sees other tokens): their
index is ``dp_cp = cp + CP*dp``, and the group kind ``dp`` — the one gradients reduce over and the
distributed optimizer shards over — holds those DP x CP ranks (Megatron's data-parallel group
with context parallelism; the DP ranks alone when CP is 1). EP divides DP x CP, as in Megatron's
expert grid (``tp-ep-dp-pp`` over the same ranks): ``ep_rank = dp_cp % EP`` and
``expert_dp_rank = dp_cp // EP``. A 512-rank layout is computed in microseconds, which is what
lets the planner and the tests reason about any rank in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

# The groups every rank joins; replicated tensors reduce over the stage-set groups below.
GROUP_KINDS = ("tp", "cp", "dp", "pp", "ep", "expert_dp")


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int
    cp: int
    dp_cp: int  # index among the DP x CP replicas of a parameter: cp + CP * dp


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp, self.ep, self.cp) < 1 or self.dp_cp % self.ep:
            raise ValueError(f"invalid layout {self}: sizes must be >= 1 and EP must divide DP x CP")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> "Layout":
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not divisible by TP*PP*CP = {tp * pp * cp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp * cp), ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dp_cp(self) -> int:
        """A parameter's data-parallel replicas: DP x CP ranks."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        return self.dp_cp // self.ep

    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return self.replica_rank(tp, cp + self.cp * dp, pp)

    def replica_rank(self, tp: int, dp_cp: int, pp: int) -> int:
        """The rank of data-parallel replica ``dp_cp`` (``Coords.dp_cp``) of (tp, pp)."""
        return tp + self.tp * (dp_cp + self.dp_cp * pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        x, pp = rest % self.dp_cp, rest // self.dp_cp
        return Coords(tp=tp, dp=x // self.cp, pp=pp, ep=x % self.ep, expert_dp=x // self.ep, cp=x % self.cp, dp_cp=x)

    def groups(self, kind: str) -> List[List[int]]:
        """Every group of ``kind`` as sorted rank lists (disjoint, together the whole world)."""
        T, X, P, E, C = self.tp, self.dp_cp, self.pp, self.ep, self.cp
        r = self.replica_rank
        if kind == "tp":
            return [[r(t, x, p) for t in range(T)] for p in range(P) for x in range(X)]
        if kind == "cp":
            return [[r(t, d * C + c, p) for c in range(C)] for p in range(P) for d in range(self.dp) for t in range(T)]
        if kind == "dp":
            return [[r(t, x, p) for x in range(X)] for p in range(P) for t in range(T)]
        if kind == "pp":
            return [[r(t, x, p) for p in range(P)] for x in range(X) for t in range(T)]
        if kind == "ep":
            return [[r(t, y * E + e, p) for e in range(E)] for p in range(P) for y in range(X // E) for t in range(T)]
        if kind == "expert_dp":
            return [[r(t, y * E + e, p) for y in range(X // E)] for p in range(P) for e in range(E) for t in range(T)]
        raise ValueError(f"unknown group kind {kind!r}; known: {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The group of ``kind`` holding ``rank``: the member of ``groups(kind)``, computed from
        the rank's coordinates (the planner asks for it per stage of a 3,072-rank layout)."""
        c, r, E, C = self.coords(rank), self.replica_rank, self.ep, self.cp
        if kind == "tp":
            return [r(t, c.dp_cp, c.pp) for t in range(self.tp)]
        if kind == "cp":
            return [r(c.tp, c.dp * C + k, c.pp) for k in range(C)]
        if kind == "dp":
            return [r(c.tp, x, c.pp) for x in range(self.dp_cp)]
        if kind == "pp":
            return [r(c.tp, c.dp_cp, p) for p in range(self.pp)]
        if kind == "ep":
            return [r(c.tp, c.expert_dp * E + e, c.pp) for e in range(E)]
        if kind == "expert_dp":
            return [r(c.tp, y * E + c.ep, c.pp) for y in range(self.expert_dp)]
        raise ValueError(f"unknown group kind {kind!r}; known: {GROUP_KINDS}")


def stage_set_groups(layout: Layout, stages, over: str, tp_block: int = 1) -> List[List[int]]:
    """All groups "``tp_block`` consecutive TP ranks x pipeline stages ``stages`` x ``over``
    (dp: the DP x CP replicas | expert_dp)" of ``layout``."""
    T, X, E = layout.tp, layout.dp_cp, layout.ep
    if over == "dp":
        dps = [list(range(X))]
    elif over == "expert_dp":
        dps = [[y * E + e for y in range(X // E)] for e in range(E)]
    else:
        raise ValueError(f"unknown reduction {over!r}")
    blocks = [range(b, b + tp_block) for b in range(0, T, tp_block)]
    return [
        sorted(layout.replica_rank(t, x, p) for p in stages for x in members for t in block)
        for members in dps
        for block in blocks
    ]
