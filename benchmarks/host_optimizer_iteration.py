"""A training iteration dominated by the host optimizer step, with AdamW, Lion and Adafactor side by
side in one run: how much an optimizer's host step costs the iteration.

    python benchmarks/host_optimizer_iteration.py [--steps 7] [--threads 1,2] [--reference]

The model is 2 layers of hidden 1024, both offloaded (``--cpu-offload-layers 2``: their weights,
gradients and optimizer state on host, stepped by the host kernels), 16 tokens per iteration,
``--bf16``, ``--device cpu``, mock data — as ``pretrain_m6.py`` runs it with those flags. For each
thread count (``--threads``: the host optimizer's and torch's, the same for every optimizer) the
settings run interleaved round by round after 2 warm-up steps; medians. ``--reference`` adds
each optimizer on the torch path (what the host step cost before the kernels). Prints the ratio
of each optimizer's iteration to AdamW's (issue 37's targets: Adafactor <= 1.2x, Lion <= 1.1x)
by the wall clock and by this process's CPU time, which other load on a shared machine does
not inflate (at one thread the two agree on a quiet machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from measure import random_microbatches  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.optim import host_kernels  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SHAPE = dict(
    vocab_size=2048,
    hidden_size=1024,
    num_layers=2,
    num_attention_heads=8,
    seq_length=16,
    micro_batch_size=1,
    global_batch_size=1,
    make_vocab_size_divisible_by=128,
    mock_data=True,
    bf16=True,
    device="cpu",
    cpu_offload_layers="2",
    lr_decay_style="constant",
    hidden_dropout=0.0,
    attention_dropout=0.0,
    weight_decay=0.01,
)
OPTIMIZERS = ("adam", "lion", "adafactor")
TARGETS = {"lion": 1.1, "adafactor": 1.2}


@contextlib.contextmanager
def torch_path(on: bool):
    """The optimizers step with their torch arithmetic (as without the host kernels) while ``on``."""
    available = host_kernels.available
    if on:
        host_kernels.available = lambda: False
    try:
        yield
    finally:
        host_kernels.available = available


def build(optimizer: str, threads: int):
    cfg = config_from_values({**SHAPE, "optimizer": optimizer, "host_optimizer_threads": threads})
    return build_train_state(cfg, ParallelState.single(torch.device("cpu")))


def measure(threads: int, steps: int, reference: bool, mbs) -> dict:
    """{label: median seconds per iteration} at ``threads`` host and torch threads."""
    torch.set_num_threads(threads)
    settings = [(f"{o}", o, False) for o in OPTIMIZERS]
    settings += [(f"{o} (torch path)", o, True) for o in OPTIMIZERS] if reference else []
    states = {}
    for label, optimizer, on_torch in settings:
        states[label] = (build(optimizer, threads), on_torch)
        with torch_path(on_torch):
            for _ in range(2):
                train_step(states[label][0], mbs)
    times = {label: ([], []) for label in states}
    for _ in range(steps):
        for label, (state, on_torch) in states.items():
            with torch_path(on_torch):
                wall, cpu = time.perf_counter(), time.process_time()
                train_step(state, mbs)
                times[label][0].append(time.perf_counter() - wall)
                times[label][1].append(time.process_time() - cpu)
    return {label: (statistics.median(w), statistics.median(c)) for label, (w, c) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--threads", type=lambda s: [int(x) for x in s.split(",")], default=sorted({1, len(os.sched_getaffinity(0))})
    )
    parser.add_argument("--reference", action="store_true", help="also each optimizer on the torch path")
    args = parser.parse_args()
    if not host_kernels.available():
        sys.exit("error: the host kernels could not be built (no C++ compiler?): nothing to compare")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mbs = random_microbatches(SHAPE["vocab_size"], SHAPE["seq_length"], 1, torch.device("cpu"))
    print(
        f"2 layers of hidden 1024, both offloaded, 16 tokens, bf16, cpu; median of {args.steps} interleaved iterations"
    )
    for threads in args.threads:
        median = measure(threads, args.steps, args.reference, mbs)
        print(f"\n{threads} thread(s) (host optimizer and torch); wall clock | this process's CPU time:")
        for label, (wall, cpu) in median.items():
            base_wall, base_cpu = median["adam (torch path)" if label.endswith("(torch path)") else "adam"]
            target = TARGETS.get(label.split()[0])
            verdict = (
                ""
                if target is None or label.endswith("(torch path)")
                else f"  target <= {target}x: {'met' if wall / base_wall <= target else 'NOT met'} | "
                f"{'met' if cpu / base_cpu <= target else 'NOT met'}"
            )
            print(
                f"  {label:<24} {wall * 1e3:8.1f} ms {wall / base_wall:5.2f}x AdamW | "
                f"{cpu * 1e3:8.1f} ms {cpu / base_cpu:5.2f}x{verdict}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
