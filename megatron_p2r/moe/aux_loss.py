"""Router auxiliary losses enter backward without being threaded through the pipeline; routing
statistics for the training log.

``attach(output, aux_loss)`` returns ``output`` unchanged; its backward gives ``aux_loss`` the
gradient ``backward_scale`` (loss scale / micro-batches: aux losses are averaged over
micro-batches, as in Megatron-LM; training passes ``set_backward_scale`` to the schedules as
their ``on_backward_scale`` hook), so the aux loss is optimised on whatever stage its layer lives.
Aux-loss values are recorded when their backward runs: once per layer and micro-batch, also
under activation recomputation (which runs the forward twice).

``record_routing`` accumulates, per MoE layer call in training, the assignments dropped over
capacity and each expert's load (assignments routed to it / the balanced share, 1.0 = even).
``pop_routing_stats`` reduces them over all ranks (a collective: every rank calls it).
Recomputation records a forward twice; the figures are a ratio, a min and a max, so that
changes nothing.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

_state = {"scale": 1.0, "values": []}


def _fresh_routing() -> dict:
    return {"dropped": 0, "assigned": 0, "min_load": math.inf, "max_load": -math.inf}


_routing = _fresh_routing()


def set_backward_scale(scale: float) -> None:
    _state["scale"] = float(scale)


def pop_recorded() -> list:
    values, _state["values"] = _state["values"], []
    return values


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        _state["values"].append(aux_loss.detach())
        return grad_output, torch.full_like(aux_loss, _state["scale"])


def attach(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    if aux_loss.requires_grad:
        return _Attach.apply(output, aux_loss)
    return output


def record_routing(dropped: int, routed: List[int]) -> None:
    """One MoE layer call: assignments dropped, and assignments routed to each expert."""
    total = sum(routed)
    if total == 0:
        return
    share = total / len(routed)
    _routing["dropped"] += dropped
    _routing["assigned"] += total
    _routing["min_load"] = min(_routing["min_load"], min(routed) / share)
    _routing["max_load"] = max(_routing["max_load"], max(routed) / share)


def pop_routing_stats(device: torch.device) -> Optional[dict]:
    """{moe_dropped_fraction, moe_min_load, moe_max_load} since the last pop, over all ranks
    (None when no rank routed a token). Collective over the default group."""
    global _routing
    r, _routing = _routing, _fresh_routing()
    sums = torch.tensor([r["dropped"], r["assigned"]], dtype=torch.float64, device=device)
    # min and max in one MAX reduction: max(-min) = -min(min)
    extremes = torch.tensor([-r["min_load"], r["max_load"]], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    dropped, assigned = sums.tolist()
    if assigned == 0:
        return None
    return {
        "moe_dropped_fraction": dropped / assigned,
        "moe_min_load": -extremes[0].item(),
        "moe_max_load": extremes[1].item(),
    }
