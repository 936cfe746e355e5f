"""MFU of a 1B-class dense transformer in bf16 at sequence 4096: model FLOPs per second over
the GPU's peak, with the matmul ceiling measured in the same run.

    python benchmarks/mfu.py [--layers 24] [--hidden 2048] [--heads 16] [--seq 4096] [--micro-batch 2]
                             [--microbatches 2] [--steps 5] [--peak-tflops F] [--tiny] [--device cuda|cpu]
                             [--json PATH]

The model is this project's M6 (GELU MLP of 4h, LayerNorm, learned positions, tied embedding,
vocab 32000): at the defaults 24 layers x 12 h^2 = 1.21e9 layer parameters plus a 65.5e6
embedding. A step is ``training.train_step`` over --microbatches micro-batches: forward and
backward in bf16 (bf16 weights, as ``--bf16`` trains, with fp32 main gradients), gradient
norm and clipping, fused AdamW over the fp32 main weights. Timed after 2 warm-up steps; the
median of --steps.

FLOPs per token are ``metrics.model_flops_per_token`` (what the training log's TFLOP/s uses):
3 x forward, forward = 2 x the matmul parameters a token touches + attention scores and values
over the full s x s square (Megatron's convention; a causal kernel does about half of that
attention work, so the figure without attention FLOPs is printed beside it).
MFU = FLOPs per step / step time / peak, where peak is the dense bf16 datasheet rate of the
GPU (``planning.hardware.GPU_PRESETS`` by device name, or --peak-tflops); the fraction of the matmul
ceiling (an 8192^3 bf16 product on random data, measured here) is printed beside it.
``--tiny`` is a CPU-sized shape (the ceiling from a 1024^3 product) that checks the script
without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Optional

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402

from measure import matmul_ceiling, random_microbatches, timed, write_json  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.metrics import model_flops_per_token  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

TINY = dict(layers=2, hidden=128, heads=4, seq=256, micro_batch=2, microbatches=1, steps=2, vocab=1024)


def datasheet_peak(device: torch.device) -> Optional[float]:
    """Dense bf16 FLOP/s of the GPU by its name (None on CPU or for an unknown GPU)."""
    if device.type != "cuda":
        return None
    from megatron_p2r.planning.hardware import GPU_PRESETS  # the planner's presets (planning/ package)

    name = torch.cuda.get_device_name(device)
    return next((g.flops16 for g in GPU_PRESETS.values() if g.name.split("-")[0] in name), None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by device name)")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized shape (checks the script)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = config_from_values(
        dict(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            seq_length=args.seq,
            vocab_size=args.vocab,
            micro_batch_size=args.micro_batch,
            global_batch_size=args.micro_batch * args.microbatches,
            bf16=True,
            mock_data=True,
            device=args.device,
            clip_grad=1.0,
            weight_decay=0.01,
            lr=1e-4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )  # as measured before Megatron's dropout 0.1 became the default
    state = build_train_state(cfg, ParallelState.single(device))
    parameters = sum(p.numel() for p in state.model.parameters())
    batches = random_microbatches(args.vocab, args.seq, args.micro_batch, device, n=args.microbatches)
    for _ in range(2):
        train_step(state, batches)
    times = [timed(lambda: train_step(state, batches), device) for _ in range(args.steps)]
    step = statistics.median(times)
    tokens = args.micro_batch * args.microbatches * args.seq
    flops = model_flops_per_token(cfg.model) * tokens
    no_attention = model_flops_per_token(dataclasses.replace(cfg.model, seq_length=0)) * tokens
    ceiling = matmul_ceiling(device, torch.bfloat16, n=1024 if args.tiny else None)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else datasheet_peak(device)
    achieved = flops / step
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    figures = {
        "device": name,
        "parameters": parameters,
        "layers": args.layers,
        "hidden": args.hidden,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "microbatches": args.microbatches,
        "tokens_per_step": tokens,
        "step_s": step,
        "step_times_s": times,
        "flops_per_step": flops,
        "achieved_flops": achieved,
        "tokens_per_s": tokens / step,
        "matmul_ceiling_flops": ceiling,
        "fraction_of_ceiling": achieved / ceiling,
        "peak_flops": peak,
        "mfu": achieved / peak if peak else None,
        "mfu_without_attention_flops": no_attention / step / peak if peak else None,
        "peak_memory_bytes": memory,
    }
    print(
        f"{name}: {parameters / 1e9:.3f}B parameters ({args.layers} layers, hidden {args.hidden}), seq {args.seq}, "
        f"{args.microbatches} x {args.micro_batch} sequences per step, bf16"
    )
    print(
        f"step {1000 * step:.1f} ms (median of {args.steps}), {tokens / step:,.0f} tokens/s, "
        f"{achieved / 1e12:.1f} model TFLOP/s" + (f", peak memory {memory / 2**30:.1f} GiB" if memory else "")
    )
    print(f"matmul ceiling {ceiling / 1e12:.1f} TFLOP/s: {achieved / ceiling:.1%} of it")
    if peak:
        print(
            f"MFU {figures['mfu']:.1%} of {peak / 1e12:.0f} TFLOP/s peak "
            f"({figures['mfu_without_attention_flops']:.1%} without attention FLOPs)"
        )
    else:
        print("MFU: no datasheet peak for this device (--peak-tflops gives one)")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
