"""``traffic.sent_bytes`` against the bytes each comm type hands its collectives on 2 and 4 gloo
ranks, forward and backward counted apart (bf16 inputs, so the ring's fp32 dK/dV show)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_p2r.context.attention import context_parallel_attention
from megatron_p2r.context.traffic import sent_bytes
from tests.harness import run_distributed

SHAPE = dict(batch=2, heads=8, kv_heads=4, local_len=8, head_dim=8)


def _count_sends(counter: list) -> None:
    """Wrap the sends of this process: point-to-point (the ring; gloo's all-to-all) and the
    all-gather / reduce-scatter (what a rank sends of them: all but its own part)."""
    batch_isend_irecv, gather, scatter = dist.batch_isend_irecv, dist.all_gather_single, dist.reduce_scatter_single
    size = dist.get_world_size()

    def p2p(ops):
        counter[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch_isend_irecv(ops)

    def all_gather(out, inp, *a, **k):
        counter[0] += (size - 1) * inp.numel() * inp.element_size()
        return gather(out, inp, *a, **k)

    def reduce_scatter(out, inp, *a, **k):
        counter[0] += (size - 1) * out.numel() * out.element_size()
        return scatter(out, inp, *a, **k)

    dist.batch_isend_irecv, dist.all_gather_single, dist.reduce_scatter_single = p2p, all_gather, reduce_scatter


def _measure(rank, size, comm_type):
    counter = [0]
    _count_sends(counter)
    b, s, d = SHAPE["batch"], SHAPE["local_len"], SHAPE["head_dim"]
    q = torch.randn(b, SHAPE["heads"], s, d, dtype=torch.bfloat16)
    k, v = (torch.randn(b, SHAPE["kv_heads"], s, d, dtype=torch.bfloat16) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*leaves, group=dist.group.WORLD, comm_type=comm_type, enable_gqa=True)
    forward = counter[0]
    out.sum().backward()
    return forward, counter[0] - forward


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_sent_bytes_is_what_the_collectives_are_handed(comm_type, size):
    measured = run_distributed(_measure, size, comm_type)
    want = sent_bytes(comm_type, size, element_bytes=2, **SHAPE)
    assert all(m == want for m in measured), (measured, want)


def test_one_rank_sends_nothing_and_unknown_types_are_refused():
    assert sent_bytes("p2p", 1, element_bytes=2, **SHAPE) == (0, 0)
    with pytest.raises(ValueError, match="--cp-comm-type ring"):
        sent_bytes("ring", 2, element_bytes=2, **SHAPE)
