"""Granular CPU offload: step time and device-resident bytes with 0, 25, 50 and 100% of the
layers offloaded, side by side in one run.

    python benchmarks/offload.py [--steps 6] [--bf16] [--device cpu|cuda] [--shape tiny|gpu|micro] [--prefetch 1]
                                 [--threads N] [--settings LABEL,...] [--json PATH]
    python benchmarks/offload.py --predict-host-step CALIBRATION.json --threads 1 [--shape optim] [--steps 6]

Offloaded layers always run under activation recomputation, so besides plain 0% the run
includes "0% + recompute" — the fair baseline for the fetch/copy bookkeeping itself —, 50%
with only the optimizer state offloaded (--cpu-offload-what optimizer) and 50% with the host
step overlapped (--overlap-cpu-optimizer-d2h-h2d: it runs on a worker thread while the resident
step and the next forward go on). At --clip-grad 0 (the other settings clip at 1.0) it compares
0% and 50% serial with 50% overlapped, whose steps then start in backward, on one and on two
host optimizer threads (--host-optimizer-threads). A timed round is two consecutive steps of one setting and the
wait for its last host step, so an overlapped step is charged what it does not hide. On CPU
(host and device are the same memory) the figures measure that bookkeeping: the copies, the
extra recompute forward, the split optimizer. On CUDA the script also measures resident and
peak device memory per setting (one setting at a time) and the step time with the H2D
fetches, D2H gradients and host AdamW. Timing: interleaved rounds, medians. Pins glibc malloc
thresholds (docs/machine.md).

``--predict-host-step FILE`` checks the planner instead: the 50% setting's host optimizer step
(the serial host stepper's ``submit``, CPU time of this process at one torch thread, median after two
warm-up steps) beside what ``tools/plan.py --host-calibration FILE`` predicts for the same
configuration on one rank (planning/host_step.py), and their ratio.

Shapes: ``tiny`` (the default; 4 layers of hidden 256) measures the bookkeeping; ``gpu`` (8
layers of hidden 2048, 4 micro-batches of 4 x 2048 tokens) is sized for one large GPU, where
a layer's compute is long enough for its prefetch to hide behind — the GPU lane
(tools/gpu_check.py) runs it with ``--bf16``; ``micro`` (4 layers of hidden 64) checks
the script in seconds, as the lane's trial on CPU runs it; ``optim`` (4 layers of hidden 768,
2 micro-batches of 2 x 64 tokens) makes the optimizer step a large share of the step, so what
the overlapped host step hides shows above the noise on CPU. ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from measure import random_microbatches, synchronize, timed, write_json  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.layout.offload import format_bytes, memory_plan  # noqa: E402
from megatron_p2r.optim import host_kernels  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.planning.estimate import make_plan  # noqa: E402
from megatron_p2r.planning.hardware import GPU_PRESETS  # noqa: E402
from megatron_p2r.planning.host_step import load_calibration  # noqa: E402
from megatron_p2r.planning.memory import stage_state_bytes  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

COMMON = dict(
    make_vocab_size_divisible_by=128,
    mock_data=True,
    clip_grad=1.0,
    weight_decay=0.01,
    lr_decay_style="constant",
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
SHAPES = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=4,
        seq_length=128,
        micro_batch_size=4,
        global_batch_size=8,
    ),
    "gpu": dict(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=8,
        num_attention_heads=16,
        seq_length=2048,
        micro_batch_size=4,
        global_batch_size=16,
    ),
    "optim": dict(
        vocab_size=2048,
        hidden_size=768,
        num_layers=4,
        num_attention_heads=8,
        seq_length=64,
        micro_batch_size=2,
        global_batch_size=4,
    ),
    "micro": dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=2,
        seq_length=32,
        micro_batch_size=2,
        global_batch_size=4,
    ),
}
FULL = "params,grads,optimizer"
OVERLAP, NO_CLIP = {"overlap_cpu_optimizer_d2h_h2d": True}, {"clip_grad": 0.0}
SETTINGS = [  # label, --cpu-offload-layers, full recomputation of every layer, --cpu-offload-what, other flags
    ("0%", None, False, FULL, {}),
    ("0% + recompute", None, True, FULL, {}),
    ("25%", "0.25", False, FULL, {}),
    ("50%", "0.5", False, FULL, {}),
    ("50% overlapped", "0.5", False, FULL, OVERLAP),
    ("100%", "1.0", False, FULL, {}),
    ("50% optim only", "0.5", False, "optimizer", {}),
    ("0% noclip", None, False, FULL, NO_CLIP),
    ("50% noclip", "0.5", False, FULL, NO_CLIP),
    ("50% in backward", "0.5", False, FULL, {**OVERLAP, **NO_CLIP}),
    ("50% bwd 2 threads", "0.5", False, FULL, {**OVERLAP, **NO_CLIP, "host_optimizer_threads": 2}),
]
RATIOS = [  # (setting, against it, what the ratio says)
    ("50% overlapped", "50%", "50% overlapped / 50% serial host step"),
    ("50% in backward", "50% noclip", "50% overlapped, started in backward / 50% serial, both --clip-grad 0"),
    ("50% in backward", "0% noclip", "50% overlapped, started in backward / no offload, both --clip-grad 0"),
    ("50% bwd 2 threads", "50% in backward", "2 host optimizer threads / 1"),
]
STEPS_PER_ROUND = 2


def build(setting, args, device):
    _, spec, recompute, what, flags = setting
    values = {
        **COMMON,
        **SHAPES[args.shape],
        "bf16": args.bf16,
        "device": device.type,
        "offload_prefetch": args.prefetch,
        "cpu_offload_what": what,
        **flags,
    }
    if recompute:  # as offloaded layers run: every layer recomputed in full
        values.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec is not None:
        values["cpu_offload_layers"] = spec
    cfg = config_from_values(values)
    return build_train_state(cfg, ParallelState.single(device))


def accounted(state) -> dict:
    if state.offload is not None:
        return state.offload.describe()
    return memory_plan(stage_state_bytes(state.plan, 0), {}, [], 0)


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def build_and_warm_up(args, device, mbs):
    """({label: state}, {label: (CUDA resident, CUDA peak)}) — settings built one at a time and
    warmed up with 2 steps (AdamW state, allocator, autotuning), so on CUDA each one's memory
    is its own (beyond what the settings before it hold)."""
    states, memory = {}, {}
    for setting in [s for s in SETTINGS if args.settings is None or s[0] in args.settings]:
        gc.collect()
        base = allocated(device)
        state = build(setting, args, device)
        resident = allocated(device) - base
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            train_step(state, mbs)
        state.optimizer.finish_host_step()
        synchronize(device)
        if device.type == "cuda":
            memory[setting[0]] = (resident, torch.cuda.max_memory_allocated(device) - base)
        states[setting[0]] = state
    return states, memory


def _round(state, mbs) -> None:
    for _ in range(STEPS_PER_ROUND):
        train_step(state, mbs)
    state.optimizer.finish_host_step()


def predict_host_step(args, device, mbs, calibration: str) -> dict:
    """The 50% setting's host step measured and predicted (``--predict-host-step``). On one rank
    (a node of one GPU), with PCIe taken as free: on CPU the copies are memory copies, which the
    planner counts in the DRAM's share."""
    label, spec, recompute, what, flags = next(s for s in SETTINGS if s[0] == "50%")
    if args.threads:  # the host kernels on --threads as well (default: --host-optimizer-threads auto)
        flags = {**flags, "host_optimizer_threads": args.threads}
    state = build((label, spec, recompute, what, flags), args, device)
    host, times = state.optimizer.host, []  # the serial host step (optim/host_step.py)
    step = host.submit

    def timed_step(*a, **k):
        start = time.process_time()
        out = step(*a, **k)
        times.append(time.process_time() - start)
        return out

    host.submit = timed_step
    for _ in range(2 + args.steps):
        train_step(state, mbs)
    measured = statistics.median(times[2:])
    gpu = GPU_PRESETS["V100-32GB"].replace(host_bw=1e30).with_node(gpus_per_node=1)
    # planned on the threads the measured step ran on: the host kernels' (optim/host_kernels.py)
    used = host_kernels.threads()
    plan = make_plan(state.cfg.replace(host_optimizer_threads=str(used)), 1, gpu, host=load_calibration(calibration))
    st = plan.stages[0]
    predicted, h = st.time_s["host_optimizer_step"], st.host_step
    print(
        f"host step, 50% offloaded ({len(st.offloaded_layers)} of {state.cfg.model.num_layers} layers): measured "
        f"{1000 * measured:.2f} ms (median of {args.steps}, CPU time), predicted {1000 * predicted:.2f} ms "
        f"({h['bytes_per_element']} B per element, {h['setting']}, at {h['bw'] / 1e9:.3g} GB/s: {h['limit']}-bound, "
        f"{h['threads']:g} threads x {h['thread_bw'] / 1e9:.3g} GB/s, {h['thread_bw_source']}); "
        f"predicted / measured {predicted / measured:.2f}"
    )
    return {
        "measured_s": measured,
        "predicted_s": predicted,
        "ratio": predicted / measured,
        "host_step": h,
        "step_times_s": times,
        "calibration": calibration,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--settings",
        type=lambda text: text.split(","),
        help="comma-separated labels of the settings to run (default: all; 0%% is always run)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--predict-host-step",
        metavar="CALIBRATION",
        help="measure the 50%% setting's host step beside the planner's prediction for the host "
        "this benchmarks/host_optimizer.py --json file describes",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.settings or ()) - {s[0] for s in SETTINGS})
    if unknown:
        parser.error(f"--settings: unknown {unknown}; the settings are {[s[0] for s in SETTINGS]}")
    if args.settings is not None:
        args.settings = {"0%", *args.settings}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # a one-rank job on an in-memory store: no port for runs side by side to share
        dist.init_process_group(
            "gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1
        )
    shape = SHAPES[args.shape]
    n_mb = shape["global_batch_size"] // shape["micro_batch_size"]
    mbs = random_microbatches(shape["vocab_size"], shape["seq_length"], shape["micro_batch_size"], device, n=n_mb)
    print(
        f"shape {args.shape}: {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
        f"vocab {shape['vocab_size']}, seq {shape['seq_length']}, {n_mb} micro-batches of "
        f"{shape['micro_batch_size']}, "
        f"{'bf16' if args.bf16 else 'fp32'}, prefetch {args.prefetch}, device {device}, "
        f"torch threads {torch.get_num_threads()}"
    )

    if args.predict_host_step:
        write_json(args.json, predict_host_step(args, device, mbs, args.predict_host_step))
        return
    states, memory = build_and_warm_up(args, device, mbs)
    times = {label: [] for label in states}
    for _ in range(args.steps):
        for label, state in states.items():
            times[label].append(timed(lambda: _round(state, mbs), device) / STEPS_PER_ROUND)

    median = {label: statistics.median(t) for label, t in times.items()}
    base, base_rc = median["0%"], median.get("0% + recompute", float("nan"))
    header = (
        f"{'setting':>18} {'layers':>6} {'ms/step':>8} {'vs 0%':>6} {'vs 0%+rc':>8} "
        f"{'device (accounted)':>19} {'host':>11} {'fetch window':>12} {'peak live':>9}"
    )
    if memory:
        header += f" {'cuda resident':>13} {'cuda peak':>11}"
    print(header)
    rows = {}
    for label, state in states.items():
        t = statistics.median(times[label])
        plan = accounted(state)
        man = state.offload
        row = {
            "layers": len(man.keys) if man else 0,
            "ms_per_step": 1000 * t,
            "vs_0": t / base,
            "vs_0_recompute": t / base_rc,
            "device_accounted": sum(plan["device"].values()),
            "host": sum(plan["host"].values()),
            "fetch_window": plan["device"]["fetch_window"],
            "peak_live_copies": max(man.stats["peak_live"].values()) if man else 0,
            "step_times_ms": [1000 * x for x in times[label]],
        }
        line = (
            f"{label:>18} {row['layers']:>6} {row['ms_per_step']:8.1f} {row['vs_0']:6.2f} "
            f"{row['vs_0_recompute']:8.2f} {format_bytes(row['device_accounted']):>19} "
            f"{format_bytes(row['host']):>11} {format_bytes(row['fetch_window']):>12} {row['peak_live_copies']:>9}"
        )
        if memory:
            row["cuda_resident"], row["cuda_peak"] = memory[label]
            line += f" {format_bytes(row['cuda_resident']):>13} {format_bytes(row['cuda_peak']):>11}"
        rows[label] = row
        print(line)
    ratios = {}
    for label, against, says in RATIOS:
        if label in median and against in median:
            ratios[says] = median[label] / median[against]
            print(f"{says}: {ratios[says]:.2f}")
    write_json(
        args.json,
        {
            "ratios": ratios,
            "device": str(device),
            "shape": args.shape,
            "shape_values": shape,
            "bf16": args.bf16,
            "prefetch": args.prefetch,
            "steps": args.steps,
            "settings": rows,
        },
    )


if __name__ == "__main__":
    main()
