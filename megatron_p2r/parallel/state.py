"""Process groups: this rank's place in a layout and the ``torch.distributed`` groups it is in.

The rank arithmetic is pure and lives in ``layout.ranks`` (``Layout``); ``initialize`` creates
the groups a ``ParallelPlan`` needs. Modules receive a ``ParallelState`` explicitly, and
``ParallelState.single()`` is the one-process reference.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.layout.plan import ParallelPlan, Reduction
from megatron_p2r.layout.ranks import GROUP_KINDS, Coords, Layout, stage_set_groups


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
    cp_size = property(lambda self: self.layout.cp)
    ep_size = property(lambda self: self.layout.ep)
    expert_dp_size = property(lambda self: self.layout.expert_dp)
    tp_rank = property(lambda self: self.coords.tp)
    pp_rank = property(lambda self: self.coords.pp)
    cp_rank = property(lambda self: self.coords.cp)
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
        """Global rank of the stage ``pp_rank`` with this rank's tp, cp and dp coordinates."""
        c = self.coords
        return self.layout.replica_rank(c.tp, c.dp_cp, pp_rank)

    def drop_groups(self) -> List[dist.ProcessGroup]:
        """Forget every group of this state and return them, each once (to be destroyed)."""
        groups = [g for g in list(self.groups.values()) + list(self._subgroups.values()) if g is not None]
        self.groups.clear()
        self._subgroups.clear()
        return list(dict.fromkeys(groups))

    def reduction_group(self, reduction: Reduction) -> Optional[dist.ProcessGroup]:
        """The group a gradient with ``reduction`` is all-reduced over (None: nothing to reduce)."""
        if not reduction.stages and reduction.tp_block == 1:
            return self.group(reduction.over)
        return self._subgroups[(reduction.stages, reduction.over, reduction.tp_block)]


def initialize(
    layout: Layout,
    device: torch.device,
    stage_sets: Sequence[Tuple[int, ...]] = (),
    timeout: Optional[datetime.timedelta] = None,
    tp_blocks: Sequence[Tuple[Tuple[int, ...], int]] = (),
) -> ParallelState:
    """Create every group of ``layout`` (collectively, in the same order on all ranks).

    Each set in ``stage_sets`` — the pipeline stages holding replicas of one tensor, as
    ``ParallelPlan.stage_sets()`` lists them — becomes groups "those stages x dp" and "those
    stages x expert-dp"; each (stages, k) of ``tp_blocks`` (``ParallelPlan.tp_block_sets()``)
    groups "k consecutive TP ranks x those stages (none: each stage alone) x dp / expert-dp"
    (see ``parallel/grads.py``). ``timeout`` bounds every collective of the groups (torch gives
    new groups 30 minutes, not the world group's timeout).
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
    keys = [(tuple(sorted(s)), 1) for s in stage_sets if len(set(s)) > 1] + [(tuple(s), k) for s, k in tp_blocks]
    for stages, block in sorted(set(keys)):
        for over in ("dp", "expert_dp"):
            for one_stage in [stages] if stages else [(p,) for p in range(layout.pp)]:
                for ranks in stage_set_groups(layout, one_stage, over, block):
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        state._subgroups[(stages, over, block)] = group
    return state


def initialize_plan(
    plan: ParallelPlan, device: torch.device, timeout: Optional[datetime.timedelta] = None
) -> ParallelState:
    """Every group ``plan``'s parameters reduce over (its stage sets and TP blocks), so a caller
    cannot forget one."""
    return initialize(plan.layout, device, plan.stage_sets(), timeout=timeout, tp_blocks=plan.tp_block_sets())
