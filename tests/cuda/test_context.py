"""Context parallelism's attention pieces on CUDA, one process: the ring's per-block kernel (on
CUDA the fp32 math kernel; CPU takes torch's fused flash kernel) against SDPA on the same block,
its log-sum-exp and its backward; and the sink-aware SDPA the one-rank path calls. The ring's
sends need NCCL and one GPU per rank (gloo has no CUDA send/recv): the CPU suite checks the ring
itself on gloo (tests/context)."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_p2r.context.attention import sdpa_with_sinks  # noqa: E402
from megatron_p2r.context.blocks import Block, allowed  # noqa: E402
from megatron_p2r.context.kernels import block_backward, block_forward  # noqa: E402

pytestmark = pytest.mark.cuda

B, HEADS, GROUPS, LENGTH, D = 2, 4, 2, 64, 32


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, LENGTH, D, generator=g)
    k, v = (torch.randn(B, GROUPS, LENGTH, D, generator=g) for _ in range(2))
    return [t.to(device).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("kind", [Block.FULL, Block.CAUSAL, Block.MASKED], ids=lambda k: k.value)
def test_ring_block_kernel_matches_sdpa_on_the_block(lane, record_property, kind):
    q, k, v = _inputs(lane.device)
    positions = torch.arange(LENGTH, device=lane.device)
    visible = {
        Block.FULL: torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=lane.device),
        Block.CAUSAL: allowed(positions, positions),
        Block.MASKED: allowed(positions, positions, window=7),
    }[kind]
    scale = 1 / math.sqrt(D)
    out, lse, keep = block_forward(q, k, v, kind, visible if kind is Block.MASKED else None, scale, 0.0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    scores = (q @ k.repeat_interleave(HEADS // GROUPS, dim=1).transpose(-1, -2)) * scale
    ref_lse = scores.masked_fill(~visible, float("-inf")).logsumexp(-1)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    delta = (grad * out).float().sum(-1)
    dq, dk, dv = block_backward(grad, q, k, v, out, lse, delta, kind, visible, scale, 0.0, keep)
    errors = {
        "out": (out - ref).abs().max().item(),
        "lse": (lse - ref_lse).abs().max().item(),
        **{n: (a - t.grad).abs().max().item() for n, a, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v))},
    }
    record_property("max_abs_errors", errors)
    assert max(errors.values()) < 1e-4, errors


def test_sink_aware_sdpa_matches_the_cpu(lane, record_property):
    q, k, v = _inputs(lane.device)
    sinks = torch.linspace(-1, 1, HEADS, device=lane.device)
    visible = allowed(*(torch.arange(LENGTH, device=lane.device),) * 2, window=9)
    out = sdpa_with_sinks(q, k, v, visible, sinks, 0.0, True)
    cpu = sdpa_with_sinks(*(t.detach().cpu() for t in (q, k, v)), visible.cpu(), sinks.cpu(), 0.0, True)
    error = (out.cpu() - cpu).abs().max().item()
    record_property("max_abs_error", error)
    assert error < 1e-5, error
