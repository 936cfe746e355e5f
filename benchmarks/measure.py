"""What the benchmark scripts share to measure on CPU or CUDA alike: synchronising before a
host clock is read, the matmul ceiling of the machine, micro-batches on the device, and the
``--json`` output the GPU lane (benchmarks/gpu_check.py) collects into its report."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Optional

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, clock=time.perf_counter) -> float:
    """Seconds one call of ``fn`` takes, device work included (``clock=time.process_time``: this
    process's CPU time, which other load on a shared CPU machine does not inflate)."""
    synchronize(device)
    start = clock()
    fn()
    synchronize(device)
    return clock() - start


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: Optional[int] = None, reps: int = 10,
                   clock=time.perf_counter) -> float:
    """FLOP/s of one large square matmul on random data (median of ``reps`` after 3 warm-ups):
    the ceiling a model's matmuls are held against. 8192 on CUDA (operands several times the
    L2), 2048 on CPU; timed with CUDA events on CUDA."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            times.append(timed(lambda: a @ b, device, clock))
    return 2 * n ** 3 / statistics.median(times)


def random_microbatches(vocab_size: int, seq_length: int, batch: int, device: torch.device, n: int = 1,
                        seed: int = 0) -> list:
    """``n`` micro-batches of random tokens in the form ``training.train_step`` takes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab_size, (batch, seq_length + 1), generator=g).to(device)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(batch, seq_length, device=device)})
    return out


def write_json(path: Optional[str], figures: dict) -> None:
    """Write ``figures`` to ``path`` (when given) for the lane's report."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=1)
