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
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.dispatcher import Dispatcher, expert_capacity, gather_rows, plan
from megatron_p2r.moe.experts import Experts
from megatron_p2r.moe.router import Router
from megatron_p2r.parallel.mappings import copy_to_region, reduce_from_region
from megatron_p2r.parallel.state import ParallelState


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.capacity_factor = cfg.moe_capacity_factor
        self.tp_group = ps.group("tp")
        self.router = Router(cfg, device)
        self.experts = Experts(cfg, ps, device)
        self.dispatcher = Dispatcher(cfg.num_experts, ps.ep_size, ps.group("ep"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x)
        capacity = expert_capacity(x.shape[0], self.router.slots, self.num_experts, self.capacity_factor)
        p = plan(routing.indices, self.num_experts, capacity)
        if self.training:
            aux_loss.record_routing(p.dropped, p.routed)
        if torch.is_autocast_enabled(x.device.type):  # send and compute in the autocast dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        slots, tokens = routing.indices.shape[1], x.shape[0]
        # p.order indexes the slot-major assignment list [slots * T]: token = order % T
        rows = gather_rows(copy_to_region(x, self.tp_group), p.order, repeats=slots)
        rows, local_counts, handle = self.dispatcher.dispatch(rows, p.counts)
        rows = self.dispatcher.combine(self.experts(rows, local_counts), handle)
        weights = copy_to_region(routing.weights.t().reshape(-1).index_select(0, p.order), self.tp_group)
        # each assignment to its own row (dropped ones stay zero), then the sum over slots
        per_slot = x.new_zeros((slots * tokens, x.shape[1]), dtype=torch.float32)
        per_slot = per_slot.index_copy(0, p.order, rows.float() * weights.unsqueeze(-1))
        out = per_slot.view(slots, tokens, -1).sum(0)
        out = reduce_from_region(out.to(rows.dtype), self.tp_group).view(shape)
        if routing.aux_loss is not None:
            out = aux_loss.attach(out, routing.aux_loss)
        return out
