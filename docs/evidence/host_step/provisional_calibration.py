"""A provisional host calibration of this machine, in benchmarks/host_optimizer.py --json's format,
until that benchmark lands: a STREAM-style triad (a = b + s c, 12 B per fp32 element) at 1 and
at all threads, and one 1-thread row, the AdamW step the offload benchmark's host placement runs
(optim/optimizer.py make_optimizer, fp32 main/grad/moments). Medians of 10 after 2 warm-ups, in
CPU time (other load on a shared machine does not inflate it; at all threads the process's CPU
time over the thread count: what the threads reach while they run).

    PYTHONPATH=$PWD python docs/evidence/host_step/provisional_calibration.py OUT.json
"""

import json
import os
import platform
import statistics
import sys
import time

import torch

from megatron_p2r.arguments import config_from_values
from megatron_p2r.optim.optimizer import make_optimizer
from megatron_p2r.optim.traffic import kernel_bytes_per_element

N = 1 << 24


def median_seconds(fn, clock) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(10):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def triad_gbs(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b, c = torch.empty(N), torch.rand(N), torch.rand(N)
    seconds = median_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), time.process_time) / threads
    return 12 * N / seconds / 1e9


def adam_row() -> dict:
    torch.set_num_threads(1)
    cfg = config_from_values(
        dict(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=32,
            vocab_size=256,
            mock_data=True,
            weight_decay=0.01,
        )
    )
    p = torch.nn.Parameter(torch.rand(N))
    p.grad = torch.rand(N)
    opt = make_optimizer([{"params": [p]}], cfg.train)
    ns = median_seconds(opt.step, time.process_time) / N * 1e9
    moments = {"exp_avg": "fp32", "exp_avg_sq": "fp32"}
    bpe = kernel_bytes_per_element("adam", "fp32", "fp32", moments, None)
    return {
        "name": f"adam fp32 ({type(opt).__name__})",
        "optimizer": "adam",
        "main": "fp32",
        "grad": "fp32",
        "moments": moments,
        "weight": None,
        "threads": 1,
        "ns_per_element": ns,
        "bytes_per_element": bpe,
        "gbs": bpe / ns,
        "ratio_to_triad": None,
    }


if __name__ == "__main__":
    cores = os.cpu_count()
    triad = {"1": triad_gbs(1), str(cores): triad_gbs(cores)}
    row = adam_row()
    row["ratio_to_triad"] = triad["1"] / row["gbs"]
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    out = {"cpu": cpu, "cores": cores, "triad_gbs": triad, "results": [row]}
    with open(sys.argv[1], "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
