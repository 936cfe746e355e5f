"""The MoE MLP: route (fp32), drop over capacity, dispatch over EP, experts, combine.

Data flow for this rank's T = b*s tokens (hidden states are replicated over TP here):

    router(x) -> indices, weights [T, slots]        fp32, identical on every TP rank
    plan       -> kept assignments sorted by expert  (capacity drops, local decision)
    dispatch   -> rows for this rank's experts       all-to-all over the ep group
    experts    -> partial rows (ffn sharded over TP)
    combine    -> rows back home; y[t] = sum_slots weight * row; dropped slots add nothing
    reduce     -> sum over TP (one all-reduce of [T, h])
    shared     -> + the shared experts (model/mlp.py SharedExperts: a dense MLP on every token, with
                  its own TP reductions; run before the dispatch, or while it is in flight)

With ``--moe-router-enable-expert-bias`` the routed rows carry the assignments per expert into
backward, where the router's ``tokens_per_expert`` counts them (``moe/expert_bias.py``).

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
from typing import List, Optional

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.dispatcher import Dispatcher, Exchange, gather_rows, pad_rows, plan, weighted_unpermute
from megatron_p2r.moe.expert_bias import count_on_backward
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
    started_all_to_all,
)
from megatron_p2r.parallel.state import ParallelState


class MoELayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        device=None,
        *,
        sequence_parallel: bool = False,
        shared_experts: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.cfg = cfg  # its capacity, drop policy and padding
        self.tp_group = ps.group("tp")
        self.sequence_group = self.tp_group if sequence_parallel else None
        # the router's losses are taken over the whole sequence: under context parallelism each CP
        # rank routes its chunks (each TP rank its shard of them under SP), so their statistics are
        # summed over the ranks sharing the sequence, as over SP's TP ranks
        statistics_group = self.sequence_group
        if ps.cp_size > 1:
            statistics_group = ps.group("tp_cp") if sequence_parallel else ps.group("cp")
        self.router = Router(cfg, device, sequence_group=statistics_group)
        self.experts = Experts(cfg, ps, device)
        self.shared_experts = shared_experts
        self.shared_expert_overlap = cfg.moe_shared_expert_overlap
        self.dispatcher = Dispatcher(cfg.num_experts, ps.ep_size, ps.group("ep"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.route(x)
        return self.finish(self.expert_rows(routed), routed.weights, routed)

    def expert_rows(self, routed: "Routed") -> torch.Tensor:
        """The routed rows through their experts and back, in ``routed.rows``' order: the
        dispatch all-to-all, the experts node (``compute``), the combine all-to-all, each
        blocking and differentiable (the serial path; ``moe.nodes`` cuts here); no moves at EP=1.
        The shared experts run first, or with ``--moe-shared-expert-overlap`` while the dispatch
        is in flight (its backward stays blocking); their output waits in ``routed.shared``."""
        d = self.dispatcher
        if d.group is None:
            self.run_shared_experts(routed)
            return self.experts(routed.rows, routed.counts)
        handle = self.exchange(routed)
        if self.shared_experts is not None and self.shared_expert_overlap:
            received, wait = started_all_to_all(routed.rows, *handle.dispatch_splits, d.group)
            self.run_shared_experts(routed)
            wait()
        else:
            self.run_shared_experts(routed)
            received = all_to_all(routed.rows, *handle.dispatch_splits, d.group)
        return all_to_all(self.compute(received, handle), *handle.combine_splits, d.group)

    def run_shared_experts(self, routed: "Routed") -> None:
        if self.shared_experts is not None:
            routed.shared = self.shared_experts(routed.shared_input)

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
        routing = self.router(x.reshape(-1, x.shape[-1]), batch=x.shape[0])
        shared_input = x if self.shared_experts is not None else None  # this rank's shard under SP
        x, indices, weights = to_compute_dtype(x), routing.indices, routing.weights  # send and compute in it
        if self.sequence_group is not None:  # the TP ranks' shards: the whole sequence, as without SP
            b, group = x.shape[0], self.sequence_group
            x = gather_from_sequence_region(x, group)
            indices = all_gather_sequence(indices.view(b, -1, indices.shape[-1]), group).flatten(0, 1)
            weights = gather_from_sequence_region(weights.view(b, -1, weights.shape[-1]), group).flatten(0, 1)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        m = self.cfg
        p = plan(indices, self.num_experts, m.expert_capacity(x.shape[0]), weights, m.moe_token_drop_policy)
        if self.training:
            aux_loss.record_routing(p.dropped, p.routed)
        slots = indices.shape[1]
        tp_region = (lambda t: t) if self.sequence_group is not None else (lambda t: copy_to_region(t, self.tp_group))
        # p.order indexes the slot-major assignment list [slots * T]: token = order % T
        rows, counts, padding = gather_rows(tp_region(x), p.order, repeats=slots), p.counts, None
        per_expert = m.padded_expert_rows(x.shape[0])
        if per_expert is not None:
            rows, padding = pad_rows(rows, counts, per_expert)
            counts = [per_expert] * self.num_experts
        if routing.aux_loss is not None:
            rows = aux_loss.attach(rows, routing.aux_loss)
        if self.training:  # the expert bias's load: the assignments each expert was given
            rows = count_on_backward(rows, p.counts, self.router)
        return Routed(
            rows=rows,
            counts=counts,
            order=p.order,
            weights=tp_region(weights.t()),
            shape=shape,
            padding=padding,
            shared_input=shared_input,
        )

    def finish(self, rows: torch.Tensor, weights: torch.Tensor, routed: "Routed") -> torch.Tensor:
        """The combined expert outputs ``rows`` (less any padding) weighted back into their tokens
        (dropped assignments add nothing), summed over TP."""
        if routed.padding is not None:
            rows = gather_rows(rows, routed.padding)
        out = weighted_unpermute(rows, weights, routed.order).view(routed.shape)
        if self.sequence_group is not None:
            out = reduce_scatter_to_sequence_region(out, self.sequence_group)
        else:
            out = reduce_from_region(out, self.tp_group)
        return out if routed.shared is None else out + routed.shared


@dataclass
class Routed:
    rows: torch.Tensor  # kept assignments' token rows, sorted by global expert
    counts: List[int]  # of them, per global expert
    order: torch.Tensor  # their indices into the slot-major assignment list
    weights: torch.Tensor  # [slots, T] combine weights (in the TP region)
    shape: torch.Size  # of the layer's (gathered) input
    padding: Optional[torch.Tensor] = None  # --moe-pad-expert-input-to-capacity: the given rows' places in ``rows``
    shared_input: Optional[torch.Tensor] = None  # the layer's input, for the shared experts
    shared: Optional[torch.Tensor] = None  # the shared experts' output, once they ran
