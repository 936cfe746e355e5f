"""Run a function on N gloo ranks in spawned processes (the distributed test harness).

``run_distributed(fn, world_size, *args)`` returns each rank's return value (in rank order).
A rank that raises makes the call fail with that rank's traceback; a stuck collective makes
it fail after ``timeout`` seconds (the process group's own timeout is shorter, so the stuck
rank reports which operation hung). Children use one thread each: the test machine has two
cores and oversubscribing them makes gloo crawl.

Ranks are forked from a ``forkserver`` that imported torch once, instead of spawned: a spawned
rank spends seconds importing torch, which dominated every distributed test. Forking from the
server (not from the caller) keeps the caller's state — an initialised process group, threads —
out of the ranks.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver. torch._dynamo is what the first torch.optim optimizer imports
# (5-13 s on the loaded 2-core machine); without it every rank that builds an optimizer pays that.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megatron_p2r.training"]


class DistributedTestError(AssertionError):
    pass


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout: float, backend: str = "gloo"
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo; ``backend="nccl"`` for the
    GPU lane's multi-GPU tests, one GPU per rank: LOCAL_RANK); return their results."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    collective_timeout = max(timeout * 0.8, 5.0)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, results, collective_timeout, backend), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, errors = {}, {}
    try:
        while len(outputs) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f}s (stuck collective?); errors so far: {errors}"
                ) from None
            (outputs if status == "ok" else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
    if errors:
        rank = min(errors)
        raise DistributedTestError(f"rank {rank} failed:\n{errors[rank]}")
    return [outputs[r] for r in range(world_size)]
