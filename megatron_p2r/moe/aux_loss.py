"""Router auxiliary losses enter backward without being threaded through the pipeline.

``attach(output, aux_loss)`` returns ``output`` unchanged; its backward gives ``aux_loss`` the
gradient ``backward_scale`` (the same factor the schedule applies to the LM loss: loss scale /
micro-batches), so the aux loss is optimised on whatever stage its layer lives.
Aux-loss values are recorded per step for logging.
"""
from __future__ import annotations

import torch

_state = {"scale": 1.0, "values": []}


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
        return grad_output, torch.full_like(aux_loss, _state["scale"])


def attach(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    if aux_loss.requires_grad:
        _state["values"].append(aux_loss.detach())
        return _Attach.apply(output, aux_loss)
    return output
