"""dispatcher.weighted_unpermute (the combine) against the plain formulation it replaced: every
kept row times its weight scattered into a zeroed fp32 [slots * T, h] buffer, summed over slots,
cast back. Outputs and both gradients, dropless (a permutation) and with dropped slots, fp32
and bf16 rows."""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.moe.dispatcher import weighted_unpermute

SLOTS, TOKENS, HIDDEN = 2, 7, 5


def reference(rows, weights, order):
    kept = rows.float() * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    per_slot = rows.new_zeros((weights.numel(), rows.shape[1]), dtype=torch.float32).index_copy(0, order, kept)
    return per_slot.view(SLOTS, TOKENS, -1).sum(0).to(rows.dtype)


def case(dropped: int, dtype):
    g = torch.Generator().manual_seed(dropped)
    order = torch.randperm(SLOTS * TOKENS, generator=g)[: SLOTS * TOKENS - dropped]
    rows = torch.randn(order.numel(), HIDDEN, generator=g).to(dtype)
    weights = torch.rand(SLOTS, TOKENS, generator=g)
    return rows, weights, order, torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)


def run(fn, rows, weights, order, grad):
    rows, weights = rows.clone().requires_grad_(), weights.clone().requires_grad_()
    out = fn(rows, weights, order)
    out.backward(grad)
    return out.float(), rows.grad.float(), weights.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dropped", [0, 3])
def test_weighted_unpermute_equals_scatter_and_sum(dropped, dtype, tol):
    rows, weights, order, grad = case(dropped, dtype)
    got, want = run(weighted_unpermute, rows, weights, order, grad), run(reference, rows, weights, order, grad)
    for name, a, b in zip(("output", "rows' gradient", "weights' gradient"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=tol, atol=tol), name
    if dropped:
        assert torch.count_nonzero(got[2]) == order.numel()  # a dropped slot's weight gets no gradient
