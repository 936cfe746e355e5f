"""The host optimizer step against its memory bound: ns and bytes per element of every optimizer
and dtype setting, at 1 thread and at all of this process's cores, beside a STREAM-style triad
measured in the same run.

    python benchmarks/host_optimizer.py [--elements 8388608] [--repeats 7] [--quick] [--json FILE]

Each setting steps a flat fp32/16-bit shard of ``--elements`` elements (Adafactor: one factored
matrix of that size, 2048 columns) with the project's host kernels (``optim/host_kernels.py``;
"adam fused fp32" is the kernel that is bitwise torch's fused AdamW, the one all-fp32 AdamW
steps with on the host). Bytes per element
are ``optim/traffic.py``'s count (what the kernel reads and writes); the bound is those bytes at
the triad's bandwidth (a = b + s c over fp32 arrays: 12 bytes per element, STREAM's count), and
``ratio_to_triad`` is the measured time over that bound (1.0 = at the bound). Timing: the
settings interleaved round by round after a warm-up step, medians of ``--repeats``. ``--json``
writes the figures for the planner (``tools/plan.py --host-calibration``). The targets of
issue 37 are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_p2r.optim import host_kernels  # noqa: E402
from megatron_p2r.optim.traffic import kernel_bytes_per_element  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TRIAD_BYTES = 12
COLUMNS = 2048  # Adafactor's matrix: elements / COLUMNS rows


@dataclass(frozen=True)
class Setting:
    name: str
    optimizer: str
    main: str
    grad: str
    moments: Dict[str, str] = field(default_factory=dict)
    weight: Optional[str] = None

    @property
    def bytes_per_element(self) -> int:
        return kernel_bytes_per_element(self.optimizer, self.main, self.grad, self.moments, self.weight)


FP32, BF16 = {"exp_avg": "fp32", "exp_avg_sq": "fp32"}, {"exp_avg": "bf16", "exp_avg_sq": "bf16"}
SETTINGS = [
    Setting("adam fused fp32", "adam", "fp32", "fp32", FP32),
    Setting("adam fp32 +bf16 weight", "adam", "fp32", "fp32", FP32, "bf16"),
    Setting("adam bf16 grad +bf16 weight", "adam", "fp32", "bf16", FP32, "bf16"),
    Setting("adam bf16 grad, bf16 moments +bf16 weight", "adam", "fp32", "bf16", BF16, "bf16"),
    Setting(
        "adam bf16 grad, fp16 moments +bf16 weight",
        "adam",
        "fp32",
        "bf16",
        {"exp_avg": "fp16", "exp_avg_sq": "fp16"},
        "bf16",
    ),
    Setting("adam fp16 main, fp16 moments", "adam", "fp16", "fp32", {"exp_avg": "fp16", "exp_avg_sq": "fp16"}),
    Setting("lion bf16 grad +bf16 weight", "lion", "fp32", "bf16", {"exp_avg": "fp32"}, "bf16"),
    Setting("lion bf16 grad, bf16 moment +bf16 weight", "lion", "fp32", "bf16", {"exp_avg": "bf16"}, "bf16"),
    Setting("lion fp16 main, fp16 moment", "lion", "fp16", "fp32", {"exp_avg": "fp16"}),
    Setting("adafactor fp32 grad +bf16 weight", "adafactor", "fp32", "fp32", {}, "bf16"),
    Setting("adafactor bf16 grad +bf16 weight", "adafactor", "fp32", "bf16", {}, "bf16"),
]
# (what, setting, against it, at most): the targets beside the bound's
COMPARISONS = [
    ("Adafactor <= 1.5x fused AdamW", "adafactor bf16 grad +bf16 weight", "adam fused fp32", 1.5),
    ("Lion <= AdamW (same dtypes)", "lion bf16 grad +bf16 weight", "adam bf16 grad +bf16 weight", 1.0),
]


def _tensor(n: int, dtype: str, fill: float = 0.0) -> torch.Tensor:
    return torch.randn(n).mul_(0.1).add_(fill).to(DTYPES[dtype]) if fill >= 0 else torch.empty(n, dtype=DTYPES[dtype])


def step_function(s: Setting, n: int) -> Callable[[], None]:
    """One step of ``s`` on fresh tensors of ``n`` elements (the tensors the step touches only)."""
    main, grad = _tensor(n, s.main), _tensor(n, s.grad)
    weight = None if s.weight is None else _tensor(n, s.weight, -1)
    moments = {name: _tensor(n, d, 1.0).abs_() for name, d in s.moments.items()}
    if s.optimizer == "adam":
        return lambda: host_kernels.adamw(
            main,
            grad,
            moments["exp_avg"],
            moments["exp_avg_sq"],
            step=10,
            lr=1e-3,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            weight=weight,
        )
    if s.optimizer == "lion":
        return lambda: host_kernels.lion(
            main, grad, moments["exp_avg"], lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, weight=weight
        )
    return adafactor_step(main, grad, weight)


def adafactor_step(main: torch.Tensor, grad: torch.Tensor, weight: Optional[torch.Tensor]) -> Callable[[], None]:
    """Adafactor's three kernel passes over one matrix, with the statistics' small arithmetic
    between them as ``optim/adafactor.py`` does it."""
    rows, cols = main.numel() // COLUMNS, COLUMNS
    row_var, col_var = torch.zeros(rows), torch.zeros(cols)

    def step():
        sums = host_kernels.adafactor_sums(0, rows, cols, 1, grad, main)
        row_var.lerp_(sums[:rows] / cols, 0.5)
        col_var.lerp_(sums[rows : rows + cols] / rows, 0.5)
        mean = row_var.mean().clamp(min=1e-30).reshape(1)
        update_sq = host_kernels.adafactor_update_sums(0, rows, cols, 1, grad, row_var, col_var, mean, 1e-60)
        scale = (
            (sums[-1:] / main.numel()).sqrt().clamp(min=1e-3) * 1e-3 / (update_sq / main.numel()).sqrt().clamp(min=1)
        )
        host_kernels.adafactor_apply(0, rows, cols, grad, main, row_var, col_var, mean, 1e-60, scale, 1.0, weight)

    return step


def set_threads(threads: int) -> None:
    host_kernels.set_threads(threads)
    torch.set_num_threads(threads)


def measure(fns: Dict[str, Callable[[], None]], threads: int, repeats: int) -> Dict[str, float]:
    """Median seconds per call of each function at ``threads``, interleaved round by round."""
    set_threads(threads)
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor()
            )
    except OSError:
        return platform.processor()


def run(elements: int, repeats: int) -> dict:
    if not host_kernels.available():
        sys.exit("error: the host kernels could not be built (no C++ compiler?): nothing to measure")
    cores = len(os.sched_getaffinity(0))
    elements = elements // COLUMNS * COLUMNS
    a, b, c = torch.zeros(elements), torch.randn(elements), torch.randn(elements)
    fns = {"triad": lambda: host_kernels.triad(a, b, c, 3.0)}
    fns.update({s.name: step_function(s, elements) for s in SETTINGS})
    report = {
        "cpu": cpu_name(),
        "cores": cores,
        "elements": elements,
        "repeats": repeats,
        "triad_gbs": {},
        "results": [],
    }
    for threads in sorted({1, cores}):
        seconds = measure(fns, threads, repeats)
        triad = TRIAD_BYTES * elements / seconds["triad"] / 1e9
        report["triad_gbs"][str(threads)] = triad
        for s in SETTINGS:
            ns = seconds[s.name] / elements * 1e9
            report["results"].append(
                {
                    "name": s.name,
                    "optimizer": s.optimizer,
                    "main": s.main,
                    "grad": s.grad,
                    "moments": s.moments,
                    "weight": s.weight,
                    "threads": threads,
                    "ns_per_element": ns,
                    "bytes_per_element": s.bytes_per_element,
                    "gbs": s.bytes_per_element / ns,
                    "ratio_to_triad": ns / (s.bytes_per_element / triad),
                }
            )
    set_threads(1)
    return report


def print_report(report: dict) -> None:
    print(
        f"{report['cpu']}, {report['cores']} cores; {report['elements']:,} elements per shard, "
        f"median of {report['repeats']} interleaved rounds"
    )
    for threads, gbs in report["triad_gbs"].items():
        print(f"\n{threads} thread(s): triad {gbs:.1f} GB/s")
        print(f"  {'setting':<44} {'ns/elem':>8} {'B/elem':>6} {'GB/s':>6} {'x bound':>7}")
        for r in report["results"]:
            if str(r["threads"]) == threads:
                print(
                    f"  {r['name']:<44} {r['ns_per_element']:8.3f} {r['bytes_per_element']:6d} {r['gbs']:6.1f} "
                    f"{r['ratio_to_triad']:7.2f}"
                )
    print("\ntargets (issue 37):")
    worst = max(report["results"], key=lambda r: r["ratio_to_triad"])
    print(
        f"  every setting within 1.5x of its traffic bound: worst {worst['ratio_to_triad']:.2f}x "
        f"({worst['name']}, {worst['threads']} thread(s)) -> {'met' if worst['ratio_to_triad'] <= 1.5 else 'NOT met'}"
    )
    for what, name, against, limit in COMPARISONS:
        for threads in report["triad_gbs"]:
            ns = {r["name"]: r["ns_per_element"] for r in report["results"] if str(r["threads"]) == threads}
            ratio = ns[name] / ns[against]
            print(f"  {what}: {ratio:.2f}x at {threads} thread(s) -> {'met' if ratio <= limit else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 23)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a small shard and 2 repeats (checks the script)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.elements, args.repeats = 1 << 16, 2
    report = run(args.elements, args.repeats)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
