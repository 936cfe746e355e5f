"""Context-parallel attention on CPU: CP2 attention forward + backward against CP1 at the same
total tokens, and how much of the ring's communication the block computation hides.

    python benchmarks/context_parallel_ring.py [--seq 4096] [--heads 8] [--kv-heads 8] [--head-dim 64]
                                               [--window W] [--rounds 5]

Two gloo processes, one thread each. Each round (medians over rounds, after one warm-up round),
interleaved in the same processes:
  CP1          rank 0 alone: the one-process core (SDPA: is_causal, or the window's mask) over the
               whole sequence
  CP2 <type>   both ranks: ``context_parallel_attention`` for p2p, allgather and a2a
  p2p blocked  both ranks: the time p2p spends blocked in its waits (a run of its own)
  p2p compute  both ranks: the ring's blocks with its sends and receives replaced by nothing;
               "alone": one rank at a time, the other idle (the work, without the two ranks
               competing for the cores)
  p2p comm     both ranks: the ring's sends alone (N-1 KV hops forward, N-1 KV and N fp32 dK/dV
               hops backward), no computation
The ring's exposed communication is ``p2p - p2p compute``; the share hidden is
``1 - exposed / comm``. "Blocked" is the exposed communication plus the waits for the slower
rank at each step. On one host a send is a copy through loopback TCP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.harness: local gloo ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_p2r.context import ring  # noqa: E402
from megatron_p2r.context.attention import context_parallel_attention  # noqa: E402
from megatron_p2r.context.chunks import chunk_positions  # noqa: E402
from tests.harness import run_distributed  # noqa: E402


@contextlib.contextmanager
def _waits_timed(waited: list):
    """The ring as it is, with the time spent blocked in its waits added to ``waited[0]``."""
    wait = ring._Ring.wait

    def timed(works):
        begin = time.perf_counter()
        wait(works)
        waited[0] += time.perf_counter() - begin

    ring._Ring.wait = staticmethod(timed)
    try:
        yield
    finally:
        ring._Ring.wait = staticmethod(wait)


@contextlib.contextmanager
def _no_communication():
    """The ring with each hop replaced by handing the tensor to itself: the same blocks, no sends."""
    start = ring._Ring.start
    ring._Ring.start = lambda self, tensor: (tensor, [])
    try:
        yield
    finally:
        ring._Ring.start = start


def _fwd_bwd(fn, *inputs) -> float:
    leaves = [t.detach().requires_grad_() for t in inputs]
    begin = time.perf_counter()
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - begin


def _comm_only(k, v, group) -> float:
    """The ring's hops without its computation."""
    hop = ring._Ring(group)
    kv = torch.stack([k, v]).contiguous()
    begin = time.perf_counter()
    for tensor, hops in ((kv, hop.size - 1), (kv, hop.size - 1), (kv.float(), hop.size)):
        for _ in range(hops):
            incoming, works = hop.start(tensor)
            hop.wait(works)
            tensor = incoming
    return time.perf_counter() - begin


def _rank(rank, size, args):
    g = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q = torch.randn(shape, generator=g)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, generator=g) for _ in range(2))
    mine = chunk_positions(args.seq, size, rank)
    local = [t[:, :, mine].contiguous() for t in (q, k, v)]
    group, gqa = dist.group.WORLD, args.heads != args.kv_heads

    def cp(comm_type):
        return lambda *t: context_parallel_attention(
            *t, group=group, comm_type=comm_type, window=args.window, enable_gqa=gqa
        )

    def one_process(*t):  # no group: the one-process core (SDPA; is_causal without a window)
        return context_parallel_attention(*t, group=None, comm_type="p2p", window=args.window, enable_gqa=gqa)

    times = {}
    for rnd in range(args.rounds + 1):
        row = {}
        dist.barrier()
        if rank == 0:
            row["CP1 (one process)"] = _fwd_bwd(one_process, q, k, v)
        dist.barrier()
        for comm_type in ("p2p", "allgather", "a2a"):
            dist.barrier()
            row[f"CP2 {comm_type}"] = _fwd_bwd(cp(comm_type), *local)
        dist.barrier()
        waited = [0.0]
        with _waits_timed(waited):
            _fwd_bwd(cp("p2p"), *local)
        row["CP2 p2p blocked"] = waited[0]
        dist.barrier()
        with _no_communication():
            row["CP2 p2p compute"] = _fwd_bwd(cp("p2p"), *local)
            for turn in range(size):  # each rank's blocks while the other one idles
                dist.barrier()
                if rank == turn:
                    row["CP2 p2p compute alone"] = _fwd_bwd(cp("p2p"), *local)
        dist.barrier()
        row["CP2 p2p comm"] = _comm_only(local[1], local[2], group)
        if rnd:  # round 0 warms up
            for name, seconds in row.items():
                times.setdefault(name, []).append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096, help="total tokens of the sequence")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=None, help="sliding window (keys before the query)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.seq % 4:
        parser.error(f"--seq {args.seq}: expected a multiple of 4 (2 chunks per CP2 rank)")
    print(
        f"attention fwd+bwd, {args.seq} tokens, {args.heads} heads ({args.kv_heads} KV), head dim "
        f"{args.head_dim}, window {args.window}; gloo, 1 thread per rank, medians of {args.rounds} rounds"
    )
    per_rank = run_distributed(_rank, 2, args, timeout=1800)
    slowest = {name: max(r.get(name, 0.0) for r in per_rank) for name in per_rank[0]}
    cp1 = slowest.get("CP1 (one process)")
    for name, seconds in slowest.items():
        ratio = f"  {seconds / cp1:.2f}x CP1" if cp1 and name != "CP1 (one process)" else ""
        print(f"  {name:<20} {seconds * 1e3:9.1f} ms{ratio}")
    exposed = slowest["CP2 p2p"] - slowest["CP2 p2p compute"]
    comm = slowest["CP2 p2p comm"]
    print(
        f"  ring communication {comm * 1e3:.1f} ms, exposed {exposed * 1e3:.1f} ms "
        f"(p2p - p2p compute): {min(1.0, max(0.0, 1 - exposed / comm)) * 100:.0f}% hidden behind the blocks; "
        f"blocked in waits {slowest['CP2 p2p blocked'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
