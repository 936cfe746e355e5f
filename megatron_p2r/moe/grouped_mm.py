"""torch's ``grouped_mm`` for the experts: where it runs, and a gradient it accepts.

``torch.nn.functional.grouped_mm`` multiplies jagged groups of rows by one weight each, with no
padding. What it supports depends on the device, the dtype and the torch build (torch 2.13: fp32,
bf16 and fp16 on CPU; bf16 on CUDA SM80+, by its documentation), and on the layout: every stride
must be a multiple of 16 bytes, and its backward rejects a gradient that is not dense (the zero
strides of ``sum()``'s gradient). So each (device, dtype, widths) is tried once on a small problem
laid out as the experts lay theirs out, forward and backward, and the answer is kept; the
experts fall back to padded ``bmm`` where it fails, saying why once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class _DenseGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (what grouped_mm's backward needs)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows[ends[g-1]:ends[g]] @ weights[g]`` for every group g, stacked: [N, k] x [G, k, n] -> [N, n].
    ``ends`` (int32) are the cumulative row counts."""
    return _DenseGradient.apply(F.grouped_mm(rows, weights, offs=ends))


def expert_weights(weight: torch.Tensor, dtype: torch.dtype, gated: bool = False) -> torch.Tensor:
    """A stacked [G, n, k] weight (or [G, n] bias) as grouped_mm's [G, k, n] operand in ``dtype``.
    ``gated``: rows interleaved (gate_j, up_j) are reordered into [gates; ups] in the same copy as
    the cast, so fc1 is one matmul whose two halves are contiguous rows for the gated unit, and
    the weight's gradient comes back as one dense tensor (two strided slices each cost a zeroed
    full-size gradient)."""
    if gated:
        weight = weight.unflatten(1, (-1, 2)).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
        weight = weight.flatten(1, 2)
    weight = weight.to(dtype)
    return weight.transpose(1, 2) if weight.dim() == 3 else weight


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int, fc1_step: int) -> bool:
    """Whether grouped_mm runs the experts' two matmuls here, forward and backward: tried once on
    two experts (one of them empty) with the experts' widths and weight layouts, in a graph of
    its own whatever surrounds the first call (no autocast, no saved-tensor hooks of a
    recomputation or offloading context). A refusal is logged, once."""
    isolated = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        with isolated, torch.enable_grad(), torch.autocast(device.type, enabled=False):
            x = torch.ones(3, hidden, device=device, dtype=dtype, requires_grad=True)
            w1 = torch.ones(2, ffn * fc1_step, hidden, device=device, dtype=dtype, requires_grad=True)
            w2 = torch.ones(2, hidden, ffn, device=device, dtype=dtype, requires_grad=True)
            ends = torch.tensor([3, 3], device=device, dtype=torch.int32)
            y = grouped_matmul(x, expert_weights(w1, dtype, gated=fc1_step == 2), ends)
            grouped_matmul(y[:, :ffn].contiguous(), expert_weights(w2, dtype), ends).sum().backward()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:  # AttributeError: a torch without it
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "--moe-grouped-gemm: torch's grouped_mm cannot run the experts in %s on %s (hidden %d, "
            "expert FFN %d per rank): %s; they use padded bmm",
            dtype,
            device,
            hidden,
            ffn,
            reason,
        )
        return False
    return True
