"""Checkpoint ownership: which rank stores each logical tensor, and which data-parallel replica
writes it, for a layout — facts of the plan, read by the checkpoint's tensor table and
fully parallel save (which add the format: names, files, dtypes) and by the planner's
checkpoint figures, so the bytes a rank is planned to write are the bytes it writes.

A logical tensor is stored once per distinct TP shard: by the first pipeline stage holding it
(replicas on later stages — the tied output weight, a pseudo slot several stages call — are
not stored again), by the first TP rank of each shard's replicas (all TP ranks' shards when it
is split, TP rank 0 otherwise) and, for experts, by the EP rank holding them. When every
data-parallel replica holds a piece whole (the fully parallel save without the distributed
optimizer), one replica writes it: greedy by bytes within each file, so the replicas of a
shard write about as much each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.tensor_specs import TensorSpec


def storing_tp_ranks(tp: int, replicas: Optional[int]) -> range:
    """The TP ranks that store a piece: the first of each shard's ``replicas`` consecutive
    holders, or TP rank 0 alone for a piece not split over TP (``replicas`` None)."""
    return range(1) if replicas is None else range(0, tp, replicas)


@dataclass(frozen=True)
class StoredTensor:
    """One logical tensor as a checkpoint stores it: the stage that stores it and its spec there
    (local shape: one TP shard; a stacked expert parameter's: this EP rank's experts)."""

    stage: int
    spec: TensorSpec

    @property
    def logical(self) -> str:
        return self.spec.logical

    def tp_ranks(self, tp: int) -> range:
        return storing_tp_ranks(tp, self.spec.tp_replicas if self.spec.tp_dim is not None else None)

    def piece_shape(self, tp: int) -> Tuple[int, ...]:
        """The global shape of one stored piece: the tensor's distinct TP shards together (one
        expert's, for a stacked expert parameter)."""
        shape = list(self.spec.shape)
        if self.spec.tp_dim is not None:
            shape[self.spec.tp_dim] *= tp // self.spec.tp_replicas
        return tuple(shape[1:] if self.spec.expert else shape)


def stored_tensors(plan: ParallelPlan) -> List[StoredTensor]:
    """Every logical tensor of the model once, stage by stage in the model's order, with the
    first stage holding it."""
    out: Dict[str, StoredTensor] = {}
    for stage in range(len(plan.stages)):
        for spec in plan.tensors(stage):
            out.setdefault(spec.logical, StoredTensor(stage, spec))
    return list(out.values())


class WrittenPiece(NamedTuple):
    """What the choice of a piece's writer depends on: the file it goes to (the stage and EP rank
    storing it; its TP shards are written by the same replica) and its bytes."""

    key: str
    stage: int
    ep_rank: int
    expert: bool
    nbytes: int


def assign_writers(pieces: Iterable[WrittenPiece], dp: int, expert_dp: int) -> Dict[str, int]:
    """Piece key -> the data-parallel (expert-data-parallel for experts) index that writes it when
    every replica holds it whole: greedy by bytes within each file, in the pieces' order."""
    load: Dict[Tuple[int, int, bool], List[int]] = {}
    out = {}
    for p in pieces:
        loads = load.setdefault((p.stage, p.ep_rank, p.expert), [0] * (expert_dp if p.expert else dp))
        writer = loads.index(min(loads))
        loads[writer] += p.nbytes
        out[p.key] = writer
    return out
