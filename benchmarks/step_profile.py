"""Where a training step's time goes: ours, the plain-PyTorch GPT and HF GPT-2 of
``step_throughput.py`` (same shape, same precision), profiled side by side in one run, their
operators' self time in classes: matmuls (``mm``/``addmm``/``bmm``), attention (SDPA and its
backward), the optimizer (AdamW, clipping, the 16-bit weight copy), and everything else
(normalization, activations, casts, reductions, copies and bookkeeping).

    python benchmarks/step_profile.py [--bf16] [--steps 3] [--top 8]

It answers what ``step_throughput.py``'s ratios cannot: which share of each step a faster
framework could still remove. Profiled CPU time with one thread; other load on a shared
machine inflates every class alike. The matmul ceiling is measured in the same run, so the
matmul share can be read as "at the ceiling" or not.
"""

from __future__ import annotations

import argparse
import collections

import pinned_malloc  # noqa: F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402

from measure import matmul_ceiling, random_microbatches, self_cpu_times  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from step_throughput import SHAPE, huggingface, ours, plain  # noqa: E402

CLASSES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("optimizer", ("adam", "foreach", "clip", "norm", "lerp", "addcdiv", "sqrt")),
)


def op_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile(step, steps: int) -> tuple:
    """({class: self CPU seconds per step}, [(op, self seconds per step)] sorted) over ``steps`` steps."""
    by_class, by_op = collections.Counter(), collections.Counter()
    for key, seconds in self_cpu_times(step, steps).items():
        if key.startswith("aten::") or key.startswith("Optimizer") or "Backward" in key:
            by_class[op_class(key)] += seconds
            by_op[key] += seconds
    return by_class, by_op.most_common()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="ours with bf16 weights, the others under bf16 autocast")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per model (after 2 warm-up steps)")
    parser.add_argument("--top", type=int, default=8, help="operators listed per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device("cpu")
    cfg = config_from_values(dict(SHAPE, bf16=args.bf16))
    batch = random_microbatches(SHAPE["vocab_size"], SHAPE["seq_length"], SHAPE["micro_batch_size"], device)[0]
    runners = {"megatron_p2r": ours(cfg, batch, device), "plain_gpt": plain(cfg, batch, device)}
    try:
        runners["hf_gpt2"] = huggingface(cfg, batch, device)
    except ImportError:
        print("transformers not installed (pip install -e .[bench]): no Hugging Face profile")
    results = {}
    for name, step in runners.items():
        for _ in range(2):
            step()
        results[name] = profile(step, args.steps)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ceiling = matmul_ceiling(device, dtype)
    print(
        f"{'bf16 (ours: bf16 weights; others: autocast)' if args.bf16 else 'fp32'}, 1 thread, "
        f"{args.steps} steps each; matmul ceiling {ceiling / 1e9:.0f} GFLOP/s; seconds of self CPU time per step"
    )
    classes = [c for c, _ in CLASSES] + ["other"]
    print(f"{'':>14} " + " ".join(f"{c:>16}" for c in classes) + f" {'total':>8}")
    for name, (by_class, _) in results.items():
        total = sum(by_class.values())
        cells = " ".join(f"{by_class[c]:7.3f} ({by_class[c] / total:5.1%})" for c in classes)
        print(f"{name:>14} {cells} {total:8.3f}")
    for name, (_, ops) in results.items():
        print(f"{name}: top operators " + ", ".join(f"{op} {s:.3f}" for op, s in ops[: args.top]))


if __name__ == "__main__":
    main()
