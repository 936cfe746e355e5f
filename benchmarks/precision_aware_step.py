"""What 16-bit AdamW moments cost the optimizer step, as a ratio to fp32 moments.

    python benchmarks/precision_aware_step.py [--elements 16777216] [--repeats 9] [--device cpu]

One fp32 main parameter of ``--elements`` elements with a gradient, stepped by torch's fused
AdamW (fp32 moments) and by ``PrecisionAwareAdamW`` (bf16 moments, as
``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``), alternately
in one process after a warm-up step; the median of ``--repeats`` each. One thread on CPU
(``OMP_NUM_THREADS=1``), the way a host step of one offloaded layer runs here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    import torch
    from benchmarks.measure import synchronize
    from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    bf16 = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    makers = {
        "fp32 moments": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "bf16 moments": lambda ps: PrecisionAwareAdamW([{"params": ps}], bf16, lr=1e-3),
    }
    optimizers = {}
    for name, make in makers.items():
        p = torch.nn.Parameter(torch.randn(args.elements, device=device))
        p.grad = torch.randn(args.elements, device=device)
        optimizers[name] = make([p])
        optimizers[name].step()
    times = {name: [] for name in optimizers}
    for _ in range(args.repeats):
        for name, opt in optimizers.items():
            synchronize(device)
            start = time.perf_counter()
            opt.step()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32 moments"])
    print(f"AdamW step of {args.elements:,} parameters on {device}, median of {args.repeats}:")
    for name, ts in times.items():
        print(f"  {name}: {statistics.median(ts) * 1e3:.1f} ms ({statistics.median(ts) / base:.2f}x)")


if __name__ == "__main__":
    main()
