"""The MoE MLP: route (fp32), drop over capacity, dispatch over EP, experts, combine.

Data flow for this rank's T = b*s tokens (hidden states are replicated over TP here):

    router(x) -> indices, weights [T, slots]        fp32, identical on every TP rank
    plan       -> kept assignments sorted by expert  (capacity drops, local decision)
    dispatch   -> rows for this rank's experts       all-to-all over the ep group
    experts    -> partial rows (ffn sharded over TP)
    combine    -> rows back home; y[t] = sum_slots weight * row; dropped slots add nothing
    reduce     -> sum over TP (one all-reduce of [T, h])

With TP the expert path must not double-count: ``x`` enters it through ``copy_to_region`` (its
gradient is the sum of the TP ranks' partial gradients) and so do the combine weights (their
gradient <g, partial row> is summed over TP too); the router path itself is replicated and
its gradients are already whole on every rank. See docs/moe.md.

Under sequence parallelism ``x`` is this rank's sequence shard: the router runs on it (its
weight's gradient is then partial, summed over TP after backward), the aux losses combine the
statistics of the TP ranks' shards, and the tokens, their routing and combine weights are
all-gathered along the sequence into the TP region (backward: reduce-scatter, which sums the
partial gradients as ``copy_to_region`` does); capacity is decided on the gathered sequence,
exactly as without sequence parallelism. The output is reduce-scattered back to the shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.dispatcher import Dispatcher, Exchange, expert_capacity, gather_rows, plan, weighted_unpermute
from megatron_p2r.moe.experts import Experts
from megatron_p2r.moe.router import Router
from megatron_p2r.parallel.layers import to_compute_dtype
from megatron_p2r.parallel.mappings import (
    all_gather_sequence,
    all_to_all,
    copy_to_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
)
from megatron_p2r.parallel.state import ParallelState


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.capacity_factor = cfg.moe_capacity_factor
        self.tp_group = ps.group("tp")
        self.sequence_group = self.tp_group if sequence_parallel else None
        # the router's losses are taken over the whole sequence: under context parallelism each CP
        # rank routes its chunks, so their statistics are summed over the CP group, as over SP's TP ranks
        statistics_group = ps.group("cp") if ps.cp_size > 1 else self.sequence_group
        self.router = Router(cfg, device, sequence_group=statistics_group)
        self.experts = Experts(cfg, ps, device)
        self.dispatcher = Dispatcher(cfg.num_experts, ps.ep_size, ps.group("ep"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.route(x)
        return self.finish(self.expert_rows(routed), routed.weights, routed)

    def expert_rows(self, routed: "Routed") -> torch.Tensor:
        """The routed rows through their experts and back, in ``routed.rows``' order: the
        dispatch all-to-all, the experts node (``compute``), the combine all-to-all, each
        blocking and differentiable (the serial path; ``moe.nodes`` cuts here); no moves at EP=1."""
        d = self.dispatcher
        if d.group is None:
            return self.experts(routed.rows, routed.counts)
        handle = self.exchange(routed)
        received = all_to_all(routed.rows, *handle.dispatch_splits, d.group)
        return all_to_all(self.compute(received, handle), *handle.combine_splits, d.group)

    def exchange(self, routed: "Routed") -> Exchange:
        """Agree with the other EP ranks on who sends how many rows (a small all-to-all of counts)."""
        return self.dispatcher.exchange(routed.counts, routed.rows.device)

    def compute(self, received: torch.Tensor, handle: Exchange) -> torch.Tensor:
        """The experts node: the local experts on the rows received from every EP rank, returned
        in the order they were received (ready for the combine all-to-all)."""
        d = self.dispatcher
        return d.unsorted(self.experts(d.sorted_by_expert(received, handle), handle.local_counts), handle)

    def route(self, x: torch.Tensor) -> "Routed":
        """Routing and the rows to dispatch, sorted by global expert (the router's aux loss rides
        on them into backward)."""
        routing = self.router(x.reshape(-1, x.shape[-1]))
        x, indices, weights = to_compute_dtype(x), routing.indices, routing.weights  # send and compute in it
        if self.sequence_group is not None:  # the TP ranks' shards: the whole sequence, as without SP
            b, group = x.shape[0], self.sequence_group
            x = gather_from_sequence_region(x, group)
            indices = all_gather_sequence(indices.view(b, -1, indices.shape[-1]), group).flatten(0, 1)
            weights = gather_from_sequence_region(weights.view(b, -1, weights.shape[-1]), group).flatten(0, 1)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        capacity = expert_capacity(x.shape[0], self.router.slots, self.num_experts, self.capacity_factor)
        p = plan(indices, self.num_experts, capacity)
        if self.training:
            aux_loss.record_routing(p.dropped, p.routed)
        slots = indices.shape[1]
        tp_region = (lambda t: t) if self.sequence_group is not None else (lambda t: copy_to_region(t, self.tp_group))
        # p.order indexes the slot-major assignment list [slots * T]: token = order % T
        rows = gather_rows(tp_region(x), p.order, repeats=slots)
        if routing.aux_loss is not None:
            rows = aux_loss.attach(rows, routing.aux_loss)
        return Routed(rows=rows, counts=p.counts, order=p.order, weights=tp_region(weights.t()), shape=shape)

    def finish(self, rows: torch.Tensor, weights: torch.Tensor, routed: "Routed") -> torch.Tensor:
        """The combined expert outputs ``rows`` weighted back into their tokens (dropped
        assignments add nothing), summed over TP."""
        out = weighted_unpermute(rows, weights, routed.order).view(routed.shape)
        if self.sequence_group is not None:
            return reduce_scatter_to_sequence_region(out, self.sequence_group)
        return reduce_from_region(out, self.tp_group)


@dataclass
class Routed:
    rows: torch.Tensor  # kept assignments' token rows, sorted by global expert
    counts: List[int]  # of them, per global expert
    order: torch.Tensor  # their indices into the slot-major assignment list
    weights: torch.Tensor  # [slots, T] combine weights (in the TP region)
    shape: torch.Size  # of the layer's (gathered) input
