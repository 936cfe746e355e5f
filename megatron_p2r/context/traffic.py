"""Bytes a CP rank sends for one attention layer and micro-batch, per ``--cp-comm-type``: the
figure a planner needs, checked against what the collectives are handed
(tests/context/test_traffic.py)."""

from __future__ import annotations


def sent_bytes(
    comm_type: str,
    size: int,
    batch: int,
    heads: int,
    kv_heads: int,
    local_len: int,
    head_dim: int,
    element_bytes: int,
) -> tuple:
    """(forward, backward) bytes one rank of a CP group of ``size`` sends, for ``heads`` query and
    ``kv_heads`` key/value heads (this TP rank's) over ``local_len`` tokens of ``element_bytes``.

    p2p: its K,V N-1 hops forward; K,V N-1 hops and the fp32 dK,dV N hops backward.
    allgather: (N-1)/N of the gathered K,V forward, of the reduce-scattered dK,dV backward.
    a2a: (N-1)/N of q, k, v and the output each way.
    """
    if size == 1:
        return 0, 0
    kv = 2 * batch * kv_heads * local_len * head_dim
    if comm_type == "p2p":
        return (size - 1) * kv * element_bytes, (size - 1) * kv * element_bytes + size * kv * 4
    if comm_type == "allgather":
        return (size - 1) * kv * element_bytes, (size - 1) * kv * element_bytes
    if comm_type == "a2a":
        moved = (2 * heads + 2 * kv_heads) // size * (size - 1) * batch * local_len * head_dim * element_bytes
        return moved, moved
    raise ValueError(f"--cp-comm-type {comm_type}: no traffic model")
