"""Plan a run on paper, and check the plan against the model built on the ``meta`` device.

    p2r-plan --config examples/m6_10t/model.yaml --pseudo-config examples/m6_10t/pseudo.yaml \
             --real-config examples/m6_10t/real.yaml --world-size 512 --gpu V100-32GB \
             --token-budget 50e9 [--json] [--verify-rank 0] [--verify-all-ranks]

Takes the same flags and YAML files as ``pretrain_m6.py`` (``--config``; command-line flags
win) plus the planner's own. With ``--pseudo-config`` / ``--real-config`` each phase is the
base configuration with that file on top; without them, the configured phase and its
counterpart (the same settings with the other ``--p2r-phase``) are planned side by side.

``--verify-rank R`` builds rank R's stage with ``model.m6.build_model(meta=True)`` under
torch's fake process group of the plan's world size and checks that the planner's tensors
(names, local shapes, TP/EP sharding, stage replicas), parameter count, parameter bytes,
buffer bytes (the routers' expert biases) and gradient-sync buckets per group equal the built
model's exactly. ``--verify-all-ranks`` does
it for every rank class (ranks of one pipeline stage hold the same shapes; each stage is
built once, and two of its ranks with different coordinates are compared) and checks that
the slices all ranks hold cover the model's logical parameter count exactly once.

With both phases planned it also reports whether Pseudo-to-Real can pay in time: r, the real
phase's step time over the pseudo phase's (offload, recomputation, gradient and optimizer
traffic the pseudo model avoids), and the break-even ``s * (1 - 1/r)``: how many more steps than
real-from-scratch a run that delinks after s steps (``--p2r-switch-iters``, default 10% of the
run) may need to reach a loss and still finish no later (``planning/breakeven.py``). The
convergence study (``p2r-study``, on your own data too) measures how many it
actually needs; given that gap (``--p2r-gap STEPS|PCT%|never``) and growth's FLOPs ratio to the
target (``--growth-flops-ratio``), the report says which of the two pays on this cluster.

Each phase's verdict checks the memory tiers and names the one that overflows, and by how much:
the GPU (the rank needing the most), the host (the node whose GPUs offload the most, against
the preset's node memory, or --host-memory per GPU / --host-memory-per-node) and, with
--cpu-offload-optimizer-nvme-path, the local NVMe (the preset's node's, or --nvme-per-node; the
host step streams the state at --nvme-bw).

The host optimizer step of offloaded layers is timed from the bytes its kernel moves per element
(``optim/traffic.py``) over min(threads x one thread's rate, the node's DRAM bandwidth shared by
its GPUs and the offload copies beside the step): the GPU preset's node (sourced cores and DRAM
peak, assumed sustained fraction and per-thread rate), ``--host-node``, or your host measured by
the host optimizer benchmark (``--host-calibration FILE``); ``--host-cores``, ``--host-dram-bw``,
``--host-thread-bw`` override single figures and ``--host-optimizer-bw`` the whole model. The
plan says which figure is measured, sourced, assumed or given, and warns where the overlapped or
delayed step makes the step slower than the variant without it (docs/offload.md).

Each phase also reports what one checkpoint costs (``planning/checkpoint_cost.py``, docs/checkpoint.md):
bytes per rank and per node, the write time at --fs-write-bw / --fs-node-write-bw, the training
stall per save with and without --async-save, and host memory during the save.

Exit status: 0 when every phase fits and every check passes, 1 otherwise, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

from megatron_p2r.arguments import build_parser, parse_args
from megatron_p2r.config import Config, ConfigError, parse_memory_size, validate
from megatron_p2r.config.batch import train_iters
from megatron_p2r.config.ranges import Range, at_least, positive
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.breakeven import measured_verdict, p2r_break_even, parse_gap
from megatron_p2r.planning.breakeven import format_p2r
from megatron_p2r.planning.checkpoint_cost import FS_WRITE_BW
from megatron_p2r.planning.estimate import Plan, make_plan
from megatron_p2r.planning.hardware import GPU_HOSTS, GPU_PRESETS, HOST_PRESETS, NVME_PRESETS, GiB, HostSpec
from megatron_p2r.planning.host_step import load_calibration, with_overrides
from megatron_p2r.planning.longest_sequence import LongestSequence, longest_sequence, plan_verdict, sequence_step
from megatron_p2r.planning.memory import expert_bias_bytes, logical_parameter_count
from megatron_p2r.planning.verdict import verdict_line

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'50e9', '5E10', '1.5e+10', '50B', '1.2T' -> a number (for --token-budget)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a count such as 50e9, 5E10, 1.5e+10, 50B or 1.2T, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_bytes(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--device-memory-budget ", "")) from None


def gap_argument(text: str):
    try:
        return parse_gap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def planner_parser() -> argparse.ArgumentParser:
    # no abbreviations: the flags it does not know are the training parser's (--seq-length is
    # not an abbreviation of --seq-length-granularity)
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("planner")
    g.add_argument("--world-size", type=int, required=True, help="GPUs of the run.")
    g.add_argument("--gpu", default="V100-32GB", choices=sorted(GPU_PRESETS), help="GPU preset.")
    g.add_argument("--gpu-memory", type=parse_bytes, help="Override the preset's memory, e.g. 40GiB.")
    g.add_argument("--gpu-flops", type=float, help="Override the preset's bf16/fp16 FLOP/s.")
    g.add_argument("--intra-node-bw", type=float, help="Override NVLink bytes/s per GPU.")
    g.add_argument("--inter-node-bw", type=float, help="Override network bytes/s per GPU.")
    g.add_argument("--host-bw", type=float, help="Override PCIe host<->device bytes/s per GPU.")
    g.add_argument("--gpus-per-node", type=int, help="Override GPUs per node.")
    host = g.add_mutually_exclusive_group()
    host.add_argument(
        "--host-memory",
        type=parse_bytes,
        help="Host memory per GPU, e.g. 192GiB (a node has --gpus-per-node times it; default: the preset's node).",
    )
    host.add_argument(
        "--host-memory-per-node",
        type=parse_bytes,
        help="Host memory per node, e.g. 1.5TiB (default: the preset's node).",
    )
    g.add_argument(
        "--nvme-per-node",
        type=parse_bytes,
        help="Local NVMe per node for --cpu-offload-optimizer-nvme-path, e.g. 15.36TB (default: the "
        "preset's node, planning/hardware.py).",
    )
    g.add_argument(
        "--nvme-bw",
        type=float,
        help="Local NVMe bytes/s per GPU, reads and writes together (default: the preset's node's "
        "drives over its GPUs, e.g. 1.25e9 for V100-32GB; planning/hardware.py).",
    )
    g.add_argument("--compute-efficiency", type=float, default=0.4, help="Fraction of peak FLOP/s the matmuls reach.")
    g.add_argument(
        "--host-optimizer-bw",
        type=float,
        help="Bytes/s one GPU's host optimizer step streams, replacing the host model (default: "
        "min(threads x --host-thread-bw, the node's --host-dram-bw shared by its GPUs and the "
        "offload copies); planning/host_step.py).",
    )
    g.add_argument(
        "--host-calibration",
        metavar="FILE",
        help="benchmarks/host_optimizer.py --json of your host: its cores, DRAM bandwidth (all-threads "
        "triad) and per-thread rate of each optimizer setting (1-thread rows) plan the host step.",
    )
    g.add_argument(
        "--host-node",
        choices=sorted(HOST_PRESETS),
        help="The node's CPUs and DRAM (default: the --gpu preset's node, planning/hardware.py).",
    )
    g.add_argument("--host-cores", type=int, help="Override the node's CPU cores.")
    g.add_argument("--host-dram-bw", type=float, help="Override the node's sustained DRAM bytes/s (all sockets).")
    g.add_argument(
        "--host-thread-bw",
        type=float,
        help="Override the bytes/s one thread's host optimizer kernel streams (every setting).",
    )
    g.add_argument(
        "--reserve",
        type=parse_bytes,
        default=GiB,
        help="Per-GPU bytes for the CUDA context, NCCL buffers and allocator slack.",
    )
    g.add_argument(
        "--fs-write-bw",
        type=float,
        default=FS_WRITE_BW,
        help="Filesystem write bytes/s, all nodes together, for the checkpoint's write time (default "
        "1e11: an assumed mid-size parallel filesystem; give your cluster's).",
    )
    g.add_argument(
        "--fs-node-write-bw",
        type=float,
        help="Filesystem write bytes/s one node reaches (default: the node's network, --inter-node-bw "
        "times --gpus-per-node).",
    )
    g.add_argument("--token-budget", type=parse_count, help="Tokens to train (for the days estimate).")
    g.add_argument(
        "--p2r-switch-iters",
        type=int,
        help="Pseudo-phase steps for the break-even (default 10%% of the run: --token-budget / tokens "
        "per step, else --train-iters).",
    )
    g.add_argument(
        "--p2r-gap",
        type=gap_argument,
        metavar="STEPS|PCT%|never",
        help="Measured: how many more steps than real-from-scratch Pseudo-to-Real needed to reach its "
        "loss (a percentage: of the run's steps), or never (p2r-study); the "
        "report then says whether P2R pays on this cluster.",
    )
    g.add_argument(
        "--growth-flops-ratio",
        type=float,
        help="Measured: depth growth's training FLOPs to real-from-scratch's loss over scratch's (the "
        "study's 'FLOPs to target'); compared with P2R's time ratio.",
    )
    g.add_argument("--pseudo-config", help="YAML applied on top of --config for the pseudo phase.")
    g.add_argument("--real-config", help="YAML applied on top of --config for the real phase.")
    g.add_argument("--json", action="store_true", help="Print the plans as JSON.")
    g.add_argument(
        "--max-seq-length",
        action="store_true",
        help="Also search each phase's longest --seq-length that fits (the planner's verdict at growing lengths).",
    )
    g.add_argument(
        "--seq-length-granularity",
        type=int,
        default=512,
        help="--max-seq-length asks lengths that are multiples of this (and of what the layout needs).",
    )
    g.add_argument(
        "--verify-rank",
        type=int,
        action="append",
        default=[],
        help="Build this rank on the meta device and compare with the plan (repeatable).",
    )
    g.add_argument(
        "--verify-all-ranks", action="store_true", help="Verify every rank class and the total parameter count."
    )
    return p


# The planner's own numbers: (flag, range); unset overrides keep the preset's value.
_PLANNER_RANGES = [
    ("world_size", at_least(1, 2**20)),
    ("gpus_per_node", at_least(1, 2**10)),
    ("compute_efficiency", Range(0.0, 1.0, low_open=True)),
    ("gpu_flops", positive()),
    ("intra_node_bw", positive()),
    ("inter_node_bw", positive()),
    ("host_bw", positive()),
    ("host_optimizer_bw", positive()),
    ("host_cores", at_least(1, 2**20)),
    ("host_dram_bw", positive()),
    ("host_thread_bw", positive()),
    ("fs_write_bw", positive()),
    ("fs_node_write_bw", positive()),
    ("token_budget", Range(0.0)),
    ("gpu_memory", at_least(1, 2**60)),
    ("host_memory", at_least(1, 2**60)),
    ("host_memory_per_node", at_least(1, 2**60)),
    ("nvme_per_node", at_least(1, 2**60)),
    ("nvme_bw", positive()),
    ("reserve", at_least(0, 2**60)),
    ("p2r_switch_iters", at_least(1)),
    ("growth_flops_ratio", positive()),
    ("seq_length_granularity", at_least(1, 2**24)),
]


def check_planner_args(args: argparse.Namespace) -> None:
    """Each planner number finite and in its range (a zero efficiency or bandwidth divides by zero)."""
    for name, limits in _PLANNER_RANGES:
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        if value is not None and not limits.contains(value):
            raise ConfigError(
                f"--{name.replace('_', '-')} must be {limits.violated(value)}, got {value} (range {limits.describe()})"
            )


def _without(rest: List[str], flag: str) -> List[str]:
    """``rest`` without ``flag`` and its value."""
    out, skip = [], False
    for arg in rest:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


# Command-line flags that mean something only to a phase that offloads (and are refused by one
# that does not): each applies to the phases where the test holds, and is left out of the others
# (a pseudo phase planned beside its real phase with the real phase's flags).
_OFFLOAD_ONLY = {"--device-memory-budget": lambda cfg: cfg.offload.cpu_offload_layers == "auto"}


def _parse_phase(rest: List[str]) -> Config:
    """The config of ``rest``, without the offload-only flags its phase has no use for."""
    for flag, applies in _OFFLOAD_ONLY.items():
        lean = _without(rest, flag)
        if lean != rest and not applies(parse_args(lean)):
            rest = lean
    return parse_args(rest)


def phase_configs(args: argparse.Namespace, rest: List[str]) -> Dict[str, Config]:
    """{phase: Config}: the base flags/YAML, with the phase file on top (flags still win)."""
    base_files = vars(build_parser().parse_args(rest)).get("config") or []
    overlays = {"pseudo": args.pseudo_config, "real": args.real_config}
    out = {}
    if any(overlays.values()):
        for phase, path in overlays.items():
            if path:
                out[phase] = _parse_phase(rest + ["--config", *base_files, path]).replace(p2r_phase=phase)
        return out
    cfg = _parse_phase(rest)
    out[cfg.p2r.p2r_phase] = cfg
    other = "real" if cfg.p2r.p2r_phase == "pseudo" else "pseudo"
    out[other] = _parse_phase(rest + ["--p2r-phase", other])
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "pseudo"))


def _cp_line(t0: dict) -> str:
    """The ring's time per micro-batch and what of it the block computation does not hide."""
    if not t0["cp_per_microbatch"]:
        return ""
    return f", cp {t0['cp_per_microbatch']:.3f} ({t0['cp_exposed_per_microbatch']:.3f} exposed)"


def planned_host(args: argparse.Namespace) -> HostSpec:
    """The node's CPUs and DRAM: --host-calibration's (measured), else --host-node's or the GPU
    preset's node (sourced and assumed), with --host-cores / --host-dram-bw / --host-thread-bw on top."""
    if args.host_calibration and args.host_node:
        raise ConfigError("--host-calibration describes the host: give it or --host-node, not both")
    host = (
        load_calibration(args.host_calibration)
        if args.host_calibration
        else HOST_PRESETS[args.host_node or GPU_HOSTS[args.gpu]]
    )
    return with_overrides(host, args.host_cores, args.host_dram_bw, args.host_thread_bw)


def check(cfg: Config, world_size: int) -> None:
    """config.validate, without requiring data (the planner reads none)."""
    if not cfg.data.has_files and not cfg.data.mock_data:
        cfg = cfg.replace(mock_data=True)
    if cfg.model.vocab_size is None:
        raise ConfigError("the planner needs --vocab-size (the embedding's size)")
    validate(cfg, world_size)


# ----------------------------------------------------------------------------- meta verification


def _spec_of(name, p) -> tuple:
    return (
        name,
        tuple(p.shape),
        getattr(p, "tp_dim", None),
        bool(getattr(p, "expert", False)),
        getattr(p, "shared_name", None),
        getattr(p, "tp_replicas", 1),
    )


def _init_fake(world_size: int, rank: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def build_meta(cfg: Config, plan: ParallelPlan, rank: int):
    """(model, ParallelState) of ``rank``, on the meta device under a fake process group."""
    import torch
    from megatron_p2r.model.m6 import build_model
    from megatron_p2r.parallel.state import initialize_plan

    _init_fake(plan.layout.world_size, rank)
    ps = initialize_plan(plan, torch.device("meta"))
    return build_model(cfg, ps, plan, meta=True), ps


def verify_rank(cfg: Config, world_size: int, rank: int) -> dict:
    """Build ``rank`` on meta and compare it with the planner; returns the figures and a list
    of mismatches (empty when the plan is exact)."""
    import torch.distributed as dist
    from megatron_p2r.parallel.grads import reduction_of

    plan = ParallelPlan.for_world(cfg, world_size)
    start = time.perf_counter()
    try:
        model, ps = build_meta(cfg, plan, rank)
        built = {n: _spec_of(n, p) for n, p in model.named_parameters()}
        params = list(model.parameters())
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        buckets = defaultdict(int)
        for name, p in model.named_parameters():
            reduction = reduction_of(plan, name, p)
            if ps.reduction_group(reduction) is not None:  # the group training all-reduces it over
                buckets[reduction.kind] += p.numel() * 4
        coords = ps.coords
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    seconds = time.perf_counter() - start
    specs = plan.tensors(coords.pp)
    planned = {s.name: (s.name, s.shape, s.tp_dim, s.expert, s.shared_name, s.tp_replicas) for s in specs}
    problems = []
    for name in sorted(set(built) | set(planned)):
        if built.get(name) != planned.get(name):
            problems.append(f"rank {rank} {name}: built {built.get(name)} != planned {planned.get(name)}")
    n_built = sum(p.numel() for p in params)
    bytes_built = sum(p.numel() * p.element_size() for p in params)
    n_planned = sum(s.numel for s in specs)
    bytes_planned = n_planned * plan.buffers.param_bytes  # the weights alone (the DDP adds bucket padding)
    if n_built != n_planned or bytes_built != bytes_planned:
        problems.append(
            f"rank {rank}: built {n_built} parameters / {bytes_built} B, planned {n_planned} / {bytes_planned} B"
        )
    planned_buffers = expert_bias_bytes(plan, coords.pp)
    if buffer_bytes != planned_buffers:
        problems.append(f"rank {rank}: built {buffer_bytes} B of buffers, planned {planned_buffers} B")
    planned_buckets = defaultdict(int)
    for s in specs:
        reduction = plan.reduction(s.logical, s.expert)
        if plan.group_members(reduction.over, reduction.stages, reduction.tp_block) > 1:
            planned_buckets[reduction.kind] += s.numel * 4
    if dict(buckets) != dict(planned_buckets):
        problems.append(
            f"rank {rank}: gradient-sync bytes per group built {dict(buckets)} != planned {dict(planned_buckets)}"
        )
    return {
        "rank": rank,
        "stage": coords.pp,
        "tp": coords.tp,
        "dp": coords.dp,
        "ep": coords.ep,
        "parameters": n_built,
        "param_bytes": bytes_built,
        "buffer_bytes": buffer_bytes,
        "grad_sync_bytes": dict(buckets),
        "build_seconds": seconds,
        "problems": problems,
        "specs": built,
    }


def verify_all_ranks(cfg: Config, world_size: int) -> dict:
    """Verify one rank per pipeline stage (and a second rank of the stage with other TP/DP
    coordinates: same shapes), then add up the logical slices every rank holds."""
    plan = ParallelPlan.for_world(cfg, world_size)
    layout = plan.layout
    results, problems, covered = [], [], {}
    for stage in range(layout.pp):
        first = verify_rank(cfg, world_size, layout.rank(0, 0, stage))
        other = verify_rank(cfg, world_size, layout.rank(layout.tp - 1, layout.dp - 1, stage, layout.cp - 1))
        problems += first["problems"] + other["problems"]
        if first["specs"] != other["specs"]:
            problems.append(f"stage {stage}: ranks {first['rank']} and {other['rank']} hold different shapes")
        results += [first, other]
        # every rank of the stage: which slice of which logical tensor it holds
        for d in range(layout.dp):
            for t in range(layout.tp):
                c = layout.coords(layout.rank(t, d, stage))
                for name, shape, tp_dim, expert, shared_name, replicas in first["specs"].values():
                    key = (shared_name or name, t // replicas if tp_dim is not None else None, c.ep if expert else None)
                    numel = 1
                    for x in shape:
                        numel *= x
                    covered[key] = numel
    total = sum(covered.values())
    expected = logical_parameter_count(plan)
    if total != expected:
        problems.append(f"all ranks together hold {total} distinct logical parameters, the model has {expected}")
    per_rank = sum(r["parameters"] for r in results[::2]) * layout.tp * layout.dp
    return {
        "ranks_built": len(results),
        "logical_parameters": total,
        "expected": expected,
        "sum_over_ranks_with_replicas": per_rank,
        "problems": problems,
        "build_seconds": sum(r["build_seconds"] for r in results),
    }


# ----------------------------------------------------------------------------- output


def _gib(n) -> str:
    return f"{n / GiB:.2f}"


def _active_and_mtp(pl: Plan) -> str:
    """'; active ... per token' for a MoE model; with multi-token prediction the depths' share and
    the rest (what DeepSeek-V3 publishes as its size), the active count being of the rest."""
    out = ""
    if pl.mtp_parameters:
        out += f"; MTP {pl.mtp_parameters:.3e}, the rest {pl.logical_parameters - pl.mtp_parameters:.3e}"
    if pl.expert_parameters:
        out += f"; active {pl.active_parameters:.3e} per token" + (" of the rest" if pl.mtp_parameters else "")
    return out


def format_plans(plans: Dict[str, Plan]) -> str:
    lines = []
    for phase, pl in plans.items():
        lay = pl.layout
        gpu = pl.gpu
        lines.append(
            f"== {phase} phase: {pl.world_size} x {gpu['name']} | TP {lay['tp']} CP {lay['cp']} PP {lay['pp']} "
            f"DP {lay['dp']} EP {lay['ep']} (expert-DP {lay['expert_dp']}) | "
            f"{pl.logical_parameters:,} parameters ({pl.logical_parameters:.3e}; experts "
            f"{pl.expert_parameters:.3e}{_active_and_mtp(pl)})"
        )
        lines.append(
            f"   global batch {pl.global_batch} sequences = {pl.tokens_per_step:,} tokens, "
            f"{pl.microbatches} micro-batches per DP rank"
        )
        head = (
            f"   {'stage':>5} {'ranks':>9} {'params/rank':>14} | GiB on device: {'params':>7} {'grads':>7} "
            f"{'optim':>7} {'fetch':>6} {'activ':>7} {'trans':>7} {'resv':>5} {'TOTAL':>7} "
            f"/{gpu['memory'] / GiB:.1f} | host GiB | act. GiB no-rc/rc"
        )
        lines.append(head)
        for st in pl.stages:
            d = st.device
            host = sum(st.host.values())
            flag = "" if st.fits else f"  <-- overflows at {st.overflow}"
            lines.append(
                f"   {st.stage:>5} {st.ranks:>9} {st.parameters:>14,} |                {_gib(d['params']):>7} "
                f"{_gib(d['grads']):>7} {_gib(d['optimizer']):>7} {_gib(d['fetch_window']):>6} "
                f"{_gib(d['activations']):>7} {_gib(d['transient']):>7} "
                f"{_gib(d['reserve']):>5} {_gib(st.device_total):>7}      | {_gib(host):>8} | "
                f"{_gib(st.activations_no_recompute)}/{_gib(st.activations_recompute)}{flag}"
            )
            if st.offloaded_layers:
                lines.append(f"         offloaded to host: {len(st.offloaded_layers)} layers {st.offloaded_layers}")
        slowest = pl.pipeline_stage  # the stage whose micro-batch sets the pipeline's time
        lines.append(
            "   communication per step per rank (GB sent): "
            + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in pl.stages[slowest].comm_bytes.items())
            + ("" if len(pl.stages) == 1 else f" (stage {slowest})")
        )
        b = pl.step_breakdown_s
        t0, t_slow = pl.stages[0].time_s, pl.stages[slowest].time_s
        hidden = (
            f" ({t_slow['pp_hidden_per_microbatch']:.3f} hidden under compute)"
            if "pp_hidden_per_microbatch" in t_slow
            else ""
        )
        lines.append(
            f"   step {pl.step_time_s:.2f} s = pipeline {b['pipeline']:.2f} (bubble {pl.pipeline_bubble:.1%}) "
            f"+ grad sync {b['grad_sync']:.2f} "
            f"+ optimizer {b['optimizer']:.2f} (per micro-batch, stage {slowest}: compute "
            f"{t_slow['compute_per_microbatch']:.3f}, tp {t_slow['tp_per_microbatch']:.3f}, ep "
            f"{t_slow['ep_per_microbatch']:.3f}, pp {t_slow['pp_per_microbatch']:.3f}{hidden}, offload transfer "
            f"{t_slow['offload_transfer_per_microbatch']:.3f}{_cp_line(t_slow)}); MFU {pl.mfu:.1%}; "
            f"{pl.tokens_per_step / pl.step_time_s:,.0f} tokens/s"
        )
        if "nvme" in pl.tiers:
            st = max(pl.stages, key=lambda st: st.nvme)
            lines.append(
                f"   on local NVMe: {_gib(st.nvme)} GiB of optimizer state per rank (stage {st.stage}); its host "
                f"step {st.time_s['host_optimizer_from_nvme']:.2f} s ({st.time_s['host_optimizer_from_ram']:.2f} s from "
                f"RAM), streaming it at "
                f"{pl.nvme['bw'] / 1e9:.3g} GB/s per GPU"
            )
        lines += _host_step_lines(pl)
        if "host_optimizer_delayed_write" in t0:  # --cpu-offload-delayed-param-update
            lines.append(
                f"   delayed parameter update (stage 0): optimizer step "
                f"{t0['host_optimizer_step']:.2f} s and weight write "
                f"{t0['host_optimizer_delayed_write']:.2f} s under the next iteration, {t0['optimizer']:.2f} s "
                f"exposed; second gradient buffer {_gib(pl.stages[0].host['grads_delayed'])} GiB per rank"
            )
        if pl.days is not None:
            hours = pl.days * 24 * pl.world_size  # GPU hours, as published runs count their cost
            lines.append(
                f"   {pl.token_budget:.3g} tokens: {pl.days:.1f} days, {hours:,.0f} GPU hours "
                f"({hours / (pl.token_budget / 1e12):,.0f} per trillion tokens)"
            )
        lines += _checkpoint_lines(pl.checkpoint)
        for problem in pl.problems:
            lines.append(f"   ! {problem}")
        for warning in pl.warnings:
            lines.append(f"   warning: {warning}")
        lines.append("   " + verdict_line(pl.tiers))
    return "\n".join(lines)


def _host_step_lines(pl: Plan) -> List[str]:
    """The host step of the stage that steps the most on host: its time, its bandwidth and where
    each input comes from (measured, sourced, assumed or given)."""
    stages = [st for st in pl.stages if st.host_step]
    if not stages:
        return []
    st = max(stages, key=lambda st: st.time_s["host_optimizer_step"])
    h = st.host_step
    name = "host step from RAM" if "host_optimizer_from_nvme" in st.time_s else "host step"
    if h["limit"].startswith("given"):
        return [
            f"   {name} (stage {st.stage}): {st.time_s['host_optimizer_step']:.2f} s, {h['bytes_per_element']} B per "
            f"element ({h['setting']}) at {h['bw'] / 1e9:.3g} GB/s per GPU ({h['limit']})"
        ]
    return [
        f"   {name} (stage {st.stage}): {st.time_s['host_optimizer_step']:.2f} s, {h['bytes_per_element']} B per "
        f"element ({h['setting']}) at {h['bw'] / 1e9:.3g} GB/s per GPU = min({h['threads']:g} threads x "
        f"{h['thread_bw'] / 1e9:.3g} GB/s, DRAM {h['dram_bw'] / 1e9:.4g} GB/s / {h['ranks_per_node']} GPUs shared "
        f"with {h['other_dram_bytes'] / 1e9:.4g} GB of offload copies and NVMe traffic = "
        f"{h['dram_share'] / 1e9:.3g} GB/s): {h['limit']}-bound; node {h['node']}",
        f"     threads: {h['threads_source']}; per thread: {h['thread_bw_source']}; cores: {h['cores_source']}; "
        f"DRAM: {h['dram_bw_source']}",
    ]


def _configured(async_save) -> str:
    """Which of the two stalls this configuration gets (nothing when the config has no --async-save)."""
    if async_save is None:
        return ""
    return " (this run: async)" if async_save else " (this run: synchronous)"


def _checkpoint_lines(c: dict) -> List[str]:
    writers = "every rank writes what it owns" if c["writers"] == "fully_parallel" else "one writer per shard"
    stall, host = c["stall_s"], c["host_bytes_during_save"]
    return [
        f"   checkpoint {c['total_bytes'] / 1e12:.3g} TB ({writers}, {c['writing_ranks']} ranks): "
        f"{c['rank_bytes_max'] / GiB:.2f} GiB per rank, {c['node_bytes_max'] / GiB:.1f} GiB per node (max); "
        f"write {c['write_s']:.1f} s at {c['fs_write_bw'] / 1e9:.3g} GB/s, {c['fs_node_write_bw'] / 1e9:.3g} GB/s "
        f"per node",
        f"   stall per save: {stall['sync']:.1f} s, with --async-save {stall['async']:.2f} s (device to host)"
        f"{_configured(c['async_save'])}; "
        f"host memory during save per rank {host['sync'] / GiB:.2f} GiB, async {host['async'] / GiB:.2f} GiB",
    ]


def p2r_summary(plans: Dict[str, Plan], configs: Dict[str, Config], args: argparse.Namespace) -> Optional[dict]:
    """r and the break-even of the planned pseudo/real pair (None unless both are planned and the
    run's length is known: --token-budget, else --train-iters / --train-samples), and with measured
    figures (--p2r-gap, --growth-flops-ratio) which method pays."""
    if set(plans) != {"pseudo", "real"}:
        return None
    real = plans["real"]
    total = (
        round(real.token_budget / real.tokens_per_step)
        if real.token_budget
        else train_iters(configs["real"], real.world_size)
    )
    if not total:
        return None
    switch = args.p2r_switch_iters if args.p2r_switch_iters is not None else max(total // 10, 1)
    if switch > total:
        raise ConfigError(
            f"--p2r-switch-iters {switch} is beyond the run's {total} steps (--token-budget / tokens "
            "per step, else --train-iters)"
        )
    summary = p2r_break_even(real.step_time_s, plans["pseudo"].step_time_s, switch, total)
    if args.p2r_gap is not None or args.growth_flops_ratio is not None:
        summary["measured"] = measured_verdict(summary, args.p2r_gap, args.growth_flops_ratio)
    return summary


def planner(args: argparse.Namespace, gpu, host: HostSpec) -> Callable[[Config], Plan]:
    """A phase's configuration to its plan on the command line's cluster (checked first)."""

    def plan_of(cfg: Config) -> Plan:
        check(cfg, args.world_size)
        return make_plan(
            cfg,
            args.world_size,
            gpu,
            efficiency=args.compute_efficiency,
            host=host,
            host_optimizer_bw=args.host_optimizer_bw,
            token_budget=args.token_budget,
            reserve=args.reserve,
            fs_write_bw=args.fs_write_bw,
            fs_node_write_bw=args.fs_node_write_bw,
            nvme=NVME_PRESETS[args.gpu].replace(per_node=args.nvme_per_node, bw=args.nvme_bw),
        )

    return plan_of


def longest_sequence_line(phase: str, found: LongestSequence) -> str:
    if found.tokens is None:
        return f"longest sequence {phase}: none fits, not even {found.step:,} tokens ({found.limit})"
    return (
        f"longest sequence {phase}: {found.tokens:,} tokens fit (lengths in steps of {found.step:,}, "
        f"{len(found.tried)} plans); the next does not fit: {found.limit}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        parser = build_parser("Plan a run: per-rank memory, communication and time (see tools/plan.py)")
        for action in planner_parser()._actions:
            parser._add_action(action)
        parser.print_help()
        return 0
    args, rest = planner_parser().parse_known_args(argv)
    try:
        check_planner_args(args)
        configs = phase_configs(args, rest)
        gpu = (
            GPU_PRESETS[args.gpu]
            .replace(
                memory=args.gpu_memory,
                flops16=args.gpu_flops,
                intra_node_bw=args.intra_node_bw,
                inter_node_bw=args.inter_node_bw,
                host_bw=args.host_bw,
            )
            .with_node(
                args.gpus_per_node, host_memory_per_gpu=args.host_memory, host_memory_per_node=args.host_memory_per_node
            )
        )
        plan_of = planner(args, gpu, planned_host(args))
        plans = {phase: plan_of(cfg) for phase, cfg in configs.items()}
        longest = {
            phase: longest_sequence(plan_verdict(cfg, plan_of), sequence_step(cfg, args.seq_length_granularity))
            for phase, cfg in configs.items()
            if args.max_seq_length
        }
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        p2r = p2r_summary(plans, configs, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ok = all(pl.fits for pl in plans.values())
    verification = {}
    for phase, cfg in configs.items():
        checks = []
        for rank in args.verify_rank:
            if not 0 <= rank < args.world_size:
                print(f"error: --verify-rank {rank} outside the world of {args.world_size} ranks", file=sys.stderr)
                return 2
            r = verify_rank(cfg, args.world_size, rank)
            r.pop("specs")
            checks.append(r)
        if args.verify_all_ranks:
            checks.append({"all_ranks": verify_all_ranks(cfg, args.world_size)})
        if checks:
            verification[phase] = checks
            ok &= not any(c.get("problems") or c.get("all_ranks", {}).get("problems") for c in checks)
    if args.json:
        print(
            json.dumps(
                {
                    "plans": {k: v.to_dict() for k, v in plans.items()},
                    "p2r": p2r,
                    "verification": verification,
                    "longest_sequence": {k: dataclasses.asdict(v) for k, v in longest.items()},
                    "ok": ok,
                },
                indent=1,
            )
        )
        return 0 if ok else 1
    print(format_plans(plans))
    for phase, found in longest.items():
        print(longest_sequence_line(phase, found))
    if p2r is not None:
        print(format_p2r(p2r))
    for phase, checks in verification.items():
        for c in checks:
            if "all_ranks" in c:
                a = c["all_ranks"]
                status = "OK" if not a["problems"] else "MISMATCH"
                print(
                    f"verify {phase} all ranks: {a['ranks_built']} meta builds in {a['build_seconds']:.1f} s; "
                    f"logical parameters {a['logical_parameters']:,} (model {a['expected']:,}); with replicas "
                    f"{a['sum_over_ranks_with_replicas']:,}: {status}"
                )
                problems = a["problems"]
            else:
                status = "OK" if not c["problems"] else "MISMATCH"
                print(
                    f"verify {phase} rank {c['rank']} (stage {c['stage']}, tp {c['tp']}, dp {c['dp']}, ep {c['ep']}): "
                    f"{c['parameters']:,} parameters, {c['param_bytes'] / GiB:.3f} GiB, meta build "
                    f"{c['build_seconds']:.2f} s: {status}"
                )
                problems = c["problems"]
            for p in problems:
                print(f"   ! {p}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
