"""The block kernels without processes: the math kernel (dropout, CUDA) against torch's fused
CPU flash kernel, for each kind of block, with GQA and a mask that leaves some queries no key."""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.context import kernels
from megatron_p2r.context.blocks import Block, allowed


@pytest.mark.parametrize("kind", [Block.FULL, Block.CAUSAL, Block.MASKED])
def test_math_kernel_matches_the_flash_kernel(kind, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(2))
    grad_out = torch.randn(2, 4, 6, 8, generator=g)
    positions = torch.arange(6)
    visible = allowed(positions + 12, positions, window=7) if kind is Block.MASKED else None  # rows 1-5 see nothing
    scale = 8**-0.5

    def run():
        out, lse, _ = kernels.block_forward(q, k, v, kind, visible, scale, 0.0)
        seen = lse.isfinite()
        delta = (grad_out * out).sum(-1)
        lse_for_grad = lse.masked_fill(~seen, 0.0)  # as if the merged lse of other blocks
        grads = kernels.block_backward(grad_out, q, k, v, out, lse_for_grad, delta, kind, visible, scale, 0.0, None)
        return out, lse, *grads

    flash = run()
    monkeypatch.setattr(kernels, "_uses_flash", lambda *args: False)
    math = run()
    if kind is Block.MASKED:
        assert flash[1][..., 1:].isneginf().all() and flash[1][..., 0].isfinite().all()
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], math, flash, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
