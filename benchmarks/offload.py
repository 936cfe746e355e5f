"""Granular CPU offload: step time and device-resident bytes with 0, 25, 50 and 100% of the
layers offloaded, side by side in one run.

    python benchmarks/offload.py [--steps 6] [--bf16] [--device cpu|cuda] [--prefetch 1] [--threads N]

Offloaded layers always run under activation recomputation, so besides plain 0% the run
includes "0% + recompute" — the fair baseline for the fetch/copy bookkeeping itself — and
50% with only the optimizer state offloaded (--cpu-offload-what optimizer). On CPU
(host and device are the same memory) the figures measure that bookkeeping: the copies, the
extra recompute forward, the split optimizer. On CUDA the script also measures resident and
peak device memory per setting (one setting at a time) and the step time with the H2D
fetches, D2H gradients and host AdamW. Timing: interleaved rounds, medians. Pins glibc malloc
thresholds as shared/MACHINE.md advises.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.layout.offload import format_bytes, memory_plan  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.planning.memory import stage_state_bytes  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SHAPE = dict(vocab_size=2048, make_vocab_size_divisible_by=128, hidden_size=256, num_layers=4,
             num_attention_heads=4, seq_length=128, micro_batch_size=4, global_batch_size=8, mock_data=True,
             clip_grad=1.0, weight_decay=0.01, lr_decay_style="constant")
FULL = "params,grads,optimizer"
SETTINGS = [  # label, --cpu-offload-layers, --recompute-activations, --cpu-offload-what
    ("0%", None, False, FULL), ("0% + recompute", None, True, FULL), ("25%", "0.25", False, FULL),
    ("50%", "0.5", False, FULL), ("100%", "1.0", False, FULL), ("50% optim only", "0.5", False, "optimizer")]


def build(setting, args, device):
    _, spec, recompute, what = setting
    values = {**SHAPE, "bf16": args.bf16, "recompute_activations": recompute, "device": device.type,
              "offload_prefetch": args.prefetch, "cpu_offload_what": what}
    if spec is not None:
        values["cpu_offload_layers"] = spec
    cfg = config_from_values(values)
    return build_train_state(cfg, ParallelState.single(device))


def microbatches(device, n=2, b=SHAPE["micro_batch_size"], seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, SHAPE["vocab_size"], (b, SHAPE["seq_length"] + 1), generator=g).to(device)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(b, SHAPE["seq_length"], device=device)})
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accounted(state) -> dict:
    if state.offload is not None:
        return state.offload.describe()
    return memory_plan(stage_state_bytes(state.plan, 0), {}, [], 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", init_method="tcp://127.0.0.1:29561",
                                rank=0, world_size=1)
    mbs = microbatches(device)
    print(f"shape: {SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']}, vocab {SHAPE['vocab_size']}, "
          f"seq {SHAPE['seq_length']}, 2 micro-batches of {SHAPE['micro_batch_size']}, "
          f"{'bf16' if args.bf16 else 'fp32'}, prefetch {args.prefetch}, device {device}, "
          f"torch threads {torch.get_num_threads()}")

    memory = {}
    if device.type == "cuda":  # one setting at a time so the figures are its own
        for setting in SETTINGS:
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            state = build(setting, args, device)
            resident = torch.cuda.memory_allocated(device) - base
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(2):
                train_step(state, mbs)
            sync(device)
            memory[setting[0]] = (resident, torch.cuda.max_memory_allocated(device) - base)
            del state

    states = {s[0]: build(s, args, device) for s in SETTINGS}
    for state in states.values():  # warm-up (AdamW state, allocator, autotuning)
        train_step(state, mbs)
        train_step(state, mbs)
    times = {label: [] for label in states}
    for _ in range(args.steps):
        for label, state in states.items():
            sync(device)
            start = time.perf_counter()
            train_step(state, mbs)
            sync(device)
            times[label].append(time.perf_counter() - start)

    base, base_rc = statistics.median(times["0%"]), statistics.median(times["0% + recompute"])
    header = (f"{'setting':>16} {'layers':>6} {'ms/step':>8} {'vs 0%':>6} {'vs 0%+rc':>8} "
              f"{'device (accounted)':>19} {'host':>11} {'fetch window':>12} {'peak live':>9}")
    if memory:
        header += f" {'cuda resident':>13} {'cuda peak':>11}"
    print(header)
    for label, state in states.items():
        t = statistics.median(times[label])
        plan = accounted(state)
        man = state.offload
        layers = len(man.keys) if man else 0
        peak = max(man.stats["peak_live"].values()) if man else 0
        line = (f"{label:>16} {layers:>6} {1000 * t:8.1f} {t / base:6.2f} {t / base_rc:8.2f} "
                f"{format_bytes(sum(plan['device'].values())):>19} {format_bytes(sum(plan['host'].values())):>11} "
                f"{format_bytes(plan['device']['fetch_window']):>12} {peak:>9}")
        if memory:
            line += f" {format_bytes(memory[label][0]):>13} {format_bytes(memory[label][1]):>11}"
        print(line)


if __name__ == "__main__":
    main()
