"""Which forwards and backwards a rank of a stage runs in one step, and the p2p buffers its link
holds meanwhile: the schedule the activation memory walks (``planning.activations``)."""
from __future__ import annotations

import functools
from typing import Tuple

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.config.schedule import COMBINED
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.pipeline.order import Op, combined_ops, pipeline_ops
from megatron_p2r.pipeline.transfers import every_link_buffers


def stage_schedule(cfg: Config, plan: ParallelPlan, stage: int) -> Tuple[Tuple[Op, ...], Tuple[int, ...]]:
    """The forwards and backwards a rank of ``stage`` runs in one step, and the p2p buffers its
    link holds during each (``pipeline.order``, ``pipeline.transfers``), for the schedule the
    config chose (``plan.schedule``). Under --overlap-moe-expert-parallel-comm the combined 1F1B
    steps (a forward and a backward in flight together: ``order.combined_ops``)."""
    s = plan.schedule
    return _schedules(s.kind, s.order, s.stages, s.chunks, num_microbatches(cfg, plan.layout.world_size),
                      s.posts_receives_ahead)[stage]


@functools.lru_cache(maxsize=8)
def _schedules(kind: str, order: str, pp: int, chunks: int, microbatches: int,
               posted_ahead: bool) -> Tuple[Tuple[Tuple[Op, ...], Tuple[int, ...]], ...]:
    """Every stage's ops and link buffers, computed together (each stage's depends on all)."""
    if kind == COMBINED:
        all_ops = [combined_ops(pp, chunks, microbatches, r) for r in range(pp)]
    else:
        all_ops = [pipeline_ops(order, pp, chunks, microbatches, r) for r in range(pp)]
    buffers = every_link_buffers(all_ops, pp, chunks, posted_ahead)
    return tuple((tuple(ops), tuple(b)) for ops, b in zip(all_ops, buffers, strict=True))
