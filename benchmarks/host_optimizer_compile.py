"""Why the host kernels are C++: torch.compile's CPU code (inductor) against the C++ kernel on the
same step, side by side in one run — first-call (compile) time and ns per element.

    python benchmarks/host_optimizer_compile.py [--elements 8388608] [--repeats 7]

The step is AdamW with bf16 gradients and bf16 moments into fp32 mains, plus the rounded bf16
weight (the precision-aware arithmetic of optim/precision_aware.py, written as torch ops for
inductor), at 1 thread. The C++ kernel's first call includes building the library when it is
not cached yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_p2r.optim import host_kernels  # noqa: E402

LR, BETA1, BETA2, EPS, WD, STEP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 10


def adamw_torch(p, g, m, v, w):
    """The same arithmetic as torch ops (inductor fuses it into one loop)."""
    g32, m32, v32 = g.float(), m.float(), v.float()
    p32 = p * (1 - LR * WD)
    m32 = torch.lerp(m32, g32, 1 - BETA1)
    v32 = v32 * BETA2 + (1 - BETA2) * g32 * g32
    denom = v32.sqrt() / (1 - BETA2**STEP) ** 0.5 + EPS
    p32 = p32 - LR / (1 - BETA1**STEP) * m32 / denom
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)
    w.copy_(p32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 23)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    host_kernels.set_threads(1)
    n = args.elements

    def tensors():
        return (
            torch.randn(n),
            torch.randn(n).bfloat16(),
            torch.zeros(n, dtype=torch.bfloat16),
            torch.zeros(n, dtype=torch.bfloat16),
            torch.empty(n, dtype=torch.bfloat16),
        )

    compiled = torch.compile(adamw_torch, dynamic=False)
    a, b = tensors(), tensors()
    fns = {
        "torch.compile (inductor)": lambda: compiled(*a),
        "C++ kernel": lambda: host_kernels.adamw(
            b[0], b[1], b[2], b[3], step=STEP, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, weight=b[4]
        ),
    }
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"AdamW, bf16 grads and moments, fp32 mains, bf16 weight; {n:,} elements, 1 thread, median of {args.repeats}")
    for name in fns:
        print(
            f"  {name:<26} first call {first[name]:6.2f} s   {statistics.median(times[name]) / n * 1e9:6.3f} ns/element"
        )


if __name__ == "__main__":
    main()
