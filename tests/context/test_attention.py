"""context_parallel_attention on N gloo ranks against the one-process attention on the whole
sequence (model.attention's window_mask / with_sink and SDPA, as Attention.core computes it):
outputs and the gradients of q, k, v and the sink logits, for each comm type, N = 2 and 4,
with GQA, a sliding window, attention sinks, fp32 (tight) and bf16 (bound below)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_p2r.context import kernels
from megatron_p2r.context.attention import check_comm_type, context_parallel_attention
from megatron_p2r.context.chunks import chunk_positions
from megatron_p2r.model.attention import window_mask, with_sink
from tests.harness import run_distributed

CHUNK = 4  # tokens per chunk: the sequence is 2N chunks
# (name, heads, kv heads, window, sinks); windows 2 and 5 cross chunk edges (masked and skipped blocks)
CASES = [
    ("plain", 4, 4, None, False),
    ("gqa", 8, 4, None, False),
    ("window", 4, 4, 5, False),
    ("narrow window", 4, 4, 2, False),
    ("sinks", 4, 4, None, True),
    ("gqa+window+sinks", 8, 4, 5, True),
]
BF16_BOUND = 2e-2  # bf16 CP output against the fp32 one-process output (inputs ~N(0, 1), d = 8)


def one_process(q, k, v, window, sinks):
    """The whole sequence in one process, exactly as Attention.core builds its SDPA call."""
    s = q.shape[2]
    mask = None
    if window is not None or sinks is not None:
        mask = window_mask(s, s if window is None else window, q.device)
    if sinks is not None:
        k, v, mask = with_sink(k, v, mask, sinks)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1]
    )


def _inputs(heads, kv_heads, seq, sinks, dtype=torch.float32):
    g = torch.Generator().manual_seed(1234)
    q, w = (torch.randn(2, heads, seq, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g) for _ in range(2))
    logits = torch.randn(heads, generator=g) if sinks else None
    return [t.to(dtype) if t is not None else None for t in (q, k, v, w, logits)]


def _check_case(rank, size, comm_type, case, dtype):
    name, heads, kv_heads, window, sinks = case
    q, k, v, w, logits = _inputs(heads, kv_heads, 2 * size * CHUNK, sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((logits,) if sinks else ())]
    ref = one_process(*leaves[:3], window, leaves[3] if sinks else None)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)

    mine = chunk_positions(2 * CHUNK * size, size, rank)
    local = [t[:, :, mine].to(dtype).detach().requires_grad_() for t in (q, k, v)]
    sink = logits.to(dtype).detach().requires_grad_() if sinks else None
    out = context_parallel_attention(
        *local,
        group=dist.group.WORLD,
        comm_type=comm_type,
        window=window,
        sink_logits=sink,
        enable_gqa=heads != kv_heads,
    )
    grads = torch.autograd.grad((out * w[:, :, mine].to(dtype)).sum(), local + ([sink] if sinks else []))
    got = [out] + [g.float() for g in grads[:3]]
    want = [ref[:, :, mine]] + [g[:, :, mine] for g in ref_grads[:3]]
    if sinks:  # each rank's sink gradient sums over its own queries (or heads, a2a): add them up
        sink_grad = grads[3].float().contiguous()
        dist.all_reduce(sink_grad)
        got.append(sink_grad)
        want.append(ref_grads[3])
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=BF16_BOUND * 4, rtol=BF16_BOUND)
    for what, a, b in zip(["out", "dq", "dk", "dv", "dsink"][: len(got)], got, want, strict=True):
        err = (a.float() - b).abs().max().item()
        assert torch.allclose(a.float(), b, **tol), f"{comm_type} N={size} {name} {dtype}: {what} off by {err:.3g}"
    return [(a.float() - b).abs().max().item() for a, b in zip(got[:4], want[:4], strict=True)]


def _worker(rank, size, comm_type, math_kernel=False):
    if math_kernel:  # the ring's blocks on the math kernel (what dropout and CUDA use) instead of CPU flash
        kernels._uses_flash = lambda *args: False
    for case in CASES:
        _check_case(rank, size, comm_type, case, torch.float32)
    return _check_case(rank, size, comm_type, CASES[-1], torch.bfloat16)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_matches_one_process_attention(comm_type, size):
    bf16_errors = [max(e) for e in zip(*run_distributed(_worker, size, comm_type), strict=True)]
    print(f"bf16 {comm_type} N={size}: max |error| of out, dq, dk, dv: " + ", ".join(f"{e:.3g}" for e in bf16_errors))
    assert bf16_errors[0] <= BF16_BOUND, bf16_errors


def test_ring_on_the_math_kernel_matches_one_process_attention():
    run_distributed(_worker, 2, "p2p", True)


def _global_loss(q, k, v, w, sink, seed, window):
    torch.manual_seed(seed)  # the same dropout masks for every evaluation of this rank's blocks
    out = context_parallel_attention(
        q,
        k,
        v,
        group=dist.group.WORLD,
        comm_type="p2p",
        window=window,
        sink_logits=sink,
        dropout_p=0.3,
        enable_gqa=True,
    )
    loss = (out * w).sum()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss, total


def _dropout_gradient_is_the_forwards(rank, size):
    """With dropout the ring's backward must use the masks its forward drew: the gradient's
    projection on a random direction equals the loss's central difference along it."""
    q, k, v, w, logits = _inputs(8, 4, 2 * size * CHUNK, True)
    mine = chunk_positions(2 * CHUNK * size, size, rank)
    leaves = [t[:, :, mine].detach().requires_grad_() for t in (q, k, v)] + [logits.detach().requires_grad_()]
    w = w[:, :, mine]
    loss, _ = _global_loss(*leaves[:3], w, leaves[3], 100 + rank, 5)
    grads = torch.autograd.grad(loss, leaves)
    direction = [torch.randn_like(t, generator=torch.Generator().manual_seed(rank)) for t in leaves[:3]]
    direction.append(torch.randn_like(logits, generator=torch.Generator().manual_seed(99)) / size)
    projected = sum((g * d).sum() for g, d in zip(grads, direction, strict=True)).detach()
    dist.all_reduce(projected)
    eps = 1e-2
    moved = [[(t + sign * eps * d).detach() for t, d in zip(leaves, direction, strict=True)] for sign in (1, -1)]
    plus, minus = (_global_loss(*m[:3], w, m[3], 100 + rank, 5)[1] for m in moved)
    assert torch.allclose(projected, (plus - minus) / (2 * eps), rtol=2e-3, atol=2e-3), (projected, plus, minus)


def test_ring_dropout_backward_uses_the_forward_masks():
    run_distributed(_dropout_gradient_is_the_forwards, 2)


def _refuses_indivisible_heads(rank, size):
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="a2a: 2 local attention heads and 1 local key/value heads"):
        context_parallel_attention(q, k, k, group=dist.group.WORLD, comm_type="a2a", enable_gqa=True)


def test_a2a_refuses_heads_not_divisible_by_cp():
    run_distributed(_refuses_indivisible_heads, 2)


@pytest.mark.parametrize("comm_type", ["a2a+p2p", "ring"])
def test_refuses_what_is_not_built_by_name(comm_type):
    with pytest.raises(ValueError, match=re.escape(f"--cp-comm-type {comm_type}:")):
        check_comm_type(comm_type)


def test_one_rank_is_the_one_process_attention():
    q, k, v, _, logits = _inputs(8, 4, 16, True)
    want = one_process(q, k, v, 5, logits)
    got = context_parallel_attention(
        q, k, v, group=None, comm_type="p2p", window=5, sink_logits=logits, enable_gqa=True
    )
    torch.testing.assert_close(got, want)
