"""What the benchmark scripts share to measure on CPU or CUDA alike: synchronising before a
host clock is read, the matmul ceiling of the machine, micro-batches on the device, the
``--json`` output the GPU lane (tools/gpu_check.py) collects into its report, and the time
and memory of a checkpoint converter's streaming loop in a process of its own."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


def matmul_ceiling(
    device: torch.device, dtype: torch.dtype, n: Optional[int] = None, reps: int = 10, clock=time.perf_counter
) -> float:
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
    return 2 * n**3 / statistics.median(times)


def self_cpu_times(step, steps: int) -> dict:
    """{profiler key: self CPU seconds per call} over ``steps`` calls of ``step`` (torch.profiler;
    the benchmarks that say where a step's time goes class these by operator)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()}


def random_microbatches(
    vocab_size: int, seq_length: int, batch: int, device: torch.device, n: int = 1, seed: int = 0
) -> list:
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


_STREAMING_CHILD = r"""
import importlib, json, sys, time

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

module = importlib.import_module(sys.argv[1])
inner, growth = getattr(module, sys.argv[2]), {}
def measured(*args, **kwargs):
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # peak RSS from here on
    before = status("VmRSS")
    inner(*args, **kwargs)
    growth["stream"] = status("VmHWM") - before
setattr(module, sys.argv[2], measured)
start = status("VmRSS")
t = time.perf_counter()
exec(sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t, "start": start, "peak": status("VmHWM"), **growth}))
"""


def run_streaming(module: str, function: str, statement: str, root: str) -> dict:
    """Run the Python ``statement`` (a conversion) in a fresh process with ``module.function`` (its
    streaming loop) wrapped: {seconds of the statement (imports excluded), RSS at start, peak RSS,
    "stream": the RSS growth while the loop ran}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", _STREAMING_CHILD, module, function, statement],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])
