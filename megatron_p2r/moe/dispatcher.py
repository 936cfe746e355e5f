"""Token dispatch: capacity drops, sorting by expert, and the expert-parallel all-to-all.

1. ``plan`` (local, no communication): the T x slots assignments of this rank's tokens are
   listed slot-major (every token's first choice, then every second choice) and stably sorted by
   expert. With a capacity factor each expert keeps at most its capacity
   ``ceil(T * slots / E * factor)`` (``ModelConfig.expert_capacity``, megatron-core's formula) of
   them, chosen as megatron-core's ``--moe-token-drop-policy`` says: ``probs``, those of the
   highest combine weights (the router's probabilities of the kept top-k); ``position``, those of
   the earliest tokens. Drops are decided on the source rank from its own tokens only, so they
   do not depend on EP. With ``--moe-pad-expert-input-to-capacity`` each expert's rows are then
   padded with zero rows to the same count (``pad_rows``), and the padding is dropped before the
   combine: its outputs weigh nothing, as megatron-core's zero-probability padding.
2. dispatch: the kept rows, grouped by global expert (so by destination EP rank, since
   rank r holds experts [r*E_local, (r+1)*E_local)), go to their rank with one all-to-all over
   the ep group. Row counts are exchanged first with a small all-to-all of per-expert counts
   (dropless routing has data-dependent sizes). The receiver reorders rows from
   (source rank, expert) to (expert, source rank) so each local expert's rows are contiguous.
3. combine: the exact reverse (inverse permutation, reverse all-to-all).

Both all-to-alls are ``parallel.mappings.all_to_all`` (differentiable; on gloo it is built from
batched isend/irecv since gloo has no all_to_all). With EP=1 no communication happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.parallel.mappings import all_to_all


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, index, repeats):
        ctx.save_for_backward(index)
        ctx.repeats, ctx.rows = repeats, src.shape[0]
        return src.index_select(0, index % ctx.rows if repeats > 1 else index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        full = grad.new_zeros((ctx.repeats * ctx.rows,) + tuple(grad.shape[1:])).index_copy_(0, index, grad)
        return full.view((ctx.repeats, ctx.rows) + tuple(grad.shape[1:])).sum(0), None, None


def gather_rows(src: torch.Tensor, index: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """Rows ``index`` of ``src`` stacked ``repeats`` times (``src.repeat(repeats, 1)``, not
    materialised); ``index`` must not repeat. Backward then scatters with ``index_copy`` (no
    accumulation) instead of ``index_select``'s ``index_add``, whose CPU ``scatter_add`` was 30% of
    the layer's time."""
    return _GatherRows.apply(src, index, repeats)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, total):
        ctx.save_for_backward(index)
        if total == rows.shape[0]:
            return torch.empty_like(rows).index_copy_(0, index, rows)
        return rows.new_zeros((total,) + tuple(rows.shape[1:])).index_copy_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def scatter_rows(rows: torch.Tensor, index: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """Row i of ``rows`` to row ``index[i]`` of ``total`` rows (default: as many, ``index`` a
    permutation: the inverse of ``gather_rows``); the rows no index names are zeros. Backward needs
    only ``index``; autograd's ``index_copy`` keeps ``rows`` too (a rows x h copy per MoE layer
    until backward)."""
    return _ScatterRows.apply(rows, index, rows.shape[0] if total is None else total)


def pad_rows(rows: torch.Tensor, counts: List[int], per_expert: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``rows``, grouped by expert with ``counts``, each group padded with zero rows to
    ``per_expert``; the padded rows' positions of the given ones). ``gather_rows(padded,
    positions)`` takes them back out."""
    counts_t = torch.tensor(counts, device=rows.device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    positions = expert * per_expert + torch.arange(rows.shape[0], device=rows.device) - starts[expert]
    return scatter_rows(rows, positions, per_expert * len(counts)), positions


class _WeightedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, order):
        slots, tokens = weights.shape
        if rows.shape[0] == slots * tokens:  # nothing dropped: ``order`` is a permutation, gather by its inverse
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            per_slot = rows.index_select(0, inverse)
        else:  # dropped slots stay zero rows
            per_slot = rows.new_zeros((slots * tokens, rows.shape[1])).index_copy_(0, order, rows)
        per_slot = per_slot.view(slots, tokens, -1)
        out = per_slot[0] * weights[0].unsqueeze(-1)  # fp32 (type promotion), no fp32 copy of the rows
        for s in range(1, slots):
            out.addcmul_(per_slot[s], weights[s].unsqueeze(-1))
        ctx.save_for_backward(per_slot, weights, order)
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        per_slot, weights, order = ctx.saved_tensors
        grad_weights = torch.mul(per_slot, grad).sum(-1, dtype=torch.float32)
        # weight * grad in fp32, written in the rows' dtype by the same kernel
        grad_per_slot = torch.mul(grad, weights.unsqueeze(-1), out=torch.empty_like(per_slot))
        return grad_per_slot.view(-1, grad.shape[-1]).index_select(0, order), grad_weights, None


def weighted_unpermute(rows: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_s weights[s, t] * row of (s, t)``, accumulated in fp32, in the rows' dtype.
    ``rows`` [K, h] are the kept assignments in ``order`` (indices into the slot-major list of
    ``weights`` [slots, T], fp32); a dropped slot adds nothing. One gather by the inverse
    permutation (dropless) and one fused multiply-add per slot, instead of an fp32 copy of the
    rows, a zeroed [slots * T, h] buffer, a scatter and a sum; backward gathers ``grad`` by
    ``order`` without any scatter."""
    return _WeightedUnpermute.apply(rows, weights, order)


@dataclass
class Plan:
    order: torch.Tensor  # kept assignments (indices into the slot-major flat list), sorted by expert
    tokens: torch.Tensor  # token index of each kept assignment
    counts: List[int]  # kept assignments per global expert
    routed: List[int]  # assignments per global expert before drops

    @property
    def dropped(self) -> int:
        return sum(self.routed) - sum(self.counts)


def plan(
    indices: torch.Tensor,
    num_experts: int,
    capacity: Optional[int] = None,
    weights: Optional[torch.Tensor] = None,
    policy: str = "probs",
) -> Plan:
    """Which assignments ``indices`` [T, slots] are kept, sorted by expert (see module doc);
    ``weights`` [T, slots] rank them under the ``probs`` policy."""
    tokens, slots = indices.shape
    flat = indices.t().reshape(-1)  # slot-major
    order = torch.argsort(flat, stable=True)
    routed_t = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:
        order = order[
            _rank_in_expert(flat, routed_t, _priority(weights, tokens, slots, policy, flat.device))[order] < capacity
        ]
        kept_t = routed_t.clamp(max=capacity)
    else:
        kept_t = routed_t
    both = torch.stack([routed_t, kept_t]).tolist()  # one host sync for both lists
    return Plan(order=order, tokens=order % tokens, counts=both[1], routed=both[0])


def _priority(weights: Optional[torch.Tensor], tokens: int, slots: int, policy: str, device) -> torch.Tensor:
    """Of the slot-major assignments, a key whose smallest values an expert keeps first: the
    token's position, or the negated combine weight (equal weights: the earlier assignment)."""
    if policy == "position":
        return torch.arange(tokens, device=device).repeat(slots)
    if policy != "probs":
        raise ValueError(f"unknown token drop policy {policy!r}")
    return -weights.detach().t().reshape(-1)


def _rank_in_expert(flat: torch.Tensor, routed: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Each assignment's place among its expert's assignments ordered by ``key`` (0 first)."""
    by_key = torch.argsort(key, stable=True)
    ranked = by_key[torch.argsort(flat[by_key], stable=True)]  # by expert, then by key
    starts = torch.cumsum(routed, 0) - routed
    rank = torch.empty_like(flat)
    rank[ranked] = torch.arange(flat.numel(), device=flat.device) - starts[flat[ranked]]
    return rank


@dataclass
class Exchange:
    """Who sends how many rows to whom in one MoE layer call (agreed before the rows move)."""

    send_splits: List[int]
    recv_splits: List[int]
    perm: torch.Tensor  # received (source, expert) order -> (expert, source) order
    local_counts: List[int]  # received rows per local expert

    @property
    def dispatch_splits(self) -> Tuple[List[int], List[int]]:
        """(output, input) splits of the rows' all-to-all to the experts' ranks."""
        return self.recv_splits, self.send_splits

    @property
    def combine_splits(self) -> Tuple[List[int], List[int]]:
        """(output, input) splits of the experts' outputs' all-to-all back home."""
        return self.send_splits, self.recv_splits


class Dispatcher:
    """Moves rows to the EP rank that holds their expert and back (identity when EP=1).

    ``exchange`` agrees on the rows' splits (a small all-to-all of counts); the rows' all-to-all
    then takes ``Exchange.dispatch_splits`` there and ``Exchange.combine_splits`` back. Between
    them ``sorted_by_expert`` and ``unsorted`` regroup the received rows for the experts. The
    MoE layer runs these pieces (``MoELayer.expert_rows`` blocking, ``moe.nodes`` cut at the
    all-to-alls for the overlapped schedule)."""

    def __init__(self, num_experts: int, ep_size: int, group: Optional[dist.ProcessGroup]):
        self.num_experts, self.ep_size, self.group = num_experts, ep_size, group
        self.num_local = num_experts // ep_size

    def exchange(self, counts: List[int], device: torch.device) -> Exchange:
        """Trade per-expert row counts (a small all-to-all: dropless sizes depend on the data)."""
        E_l, P = self.num_local, self.ep_size
        sent = torch.tensor(counts, dtype=torch.int64, device=device)
        received = all_to_all(sent, [E_l] * P, [E_l] * P, self.group).view(P, E_l)  # [source, local expert]
        recv_counts = received.tolist()
        expert_of_row = torch.arange(E_l, device=device).repeat(P).repeat_interleave(received.reshape(-1))
        return Exchange(
            send_splits=[sum(counts[r * E_l : (r + 1) * E_l]) for r in range(P)],
            recv_splits=[sum(row) for row in recv_counts],
            perm=torch.argsort(expert_of_row, stable=True),
            local_counts=[sum(recv_counts[r][e] for r in range(P)) for e in range(E_l)],
        )

    @staticmethod
    def sorted_by_expert(received: torch.Tensor, handle: Exchange) -> torch.Tensor:
        return gather_rows(received, handle.perm)

    @staticmethod
    def unsorted(rows: torch.Tensor, handle: Exchange) -> torch.Tensor:
        """The inverse of ``sorted_by_expert``: back to the order the rows were received in."""
        return scatter_rows(rows, handle.perm)
