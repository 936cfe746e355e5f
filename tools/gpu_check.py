"""The GPU lane in one command: the CUDA tests, then the GPU benchmarks, one report.

    python tools/gpu_check.py [--out gpu_report] [--only STEP,...] [--dry-run-tests] [--budget S]
    python tools/gpu_check.py --estimate gpu_report/report.json     # the schedule on a GPU

What ``make gpu-check`` runs (docs/gpu.md). Steps (``STEPS``), in the order a user meets what they
check — one-rank bf16 training first, then offload and the host step, checkpoints, MoE, the
kernels only CUDA selects, the planner, then the speed figures — each a subprocess with its own
time limit (on expiry its whole process group is killed and the step is reported as
``timeout``); a step that fails does not stop the next. The limits add up to at most
``BUDGET`` (720 s, 12 of a lend's 15 minutes) and the lane never runs past it: a step gets its
limit or what is left, and is "skipped for time" when less than ``MIN_STEP`` is left.

The report — ``report.json`` (every figure) and ``report.md`` (what ran, what was skipped and
why, each figure) — is rewritten after every step in ``--out`` and, when the variable OUT is
set, copied there with the combined log and the offload profiler trace, so a run cut short
still leaves what it measured. Without a CUDA device this is a trial on CPU: the CUDA tests
skip (``--dry-run-tests`` runs their CPU parts instead, up to the CUDA call), the benchmarks
run their smallest shapes (``--tiny``, ``--shape micro``, ``--quick``), each step on one thread
with 5 times its limit; it checks everything but the GPU (the suite runs it:
tests/test_gpu_lane.py). Exit status 0 when every step passed.

Standard library only: it must start on any Python, whatever its torch.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_FILES = ("report.json", "report.md", "gpu_check.log", "offload_trace.json")  # what goes to $OUT (<= 8)
TARGETS = {"mfu": 0.45, "offload_50": 0.15}
BUDGET = 720  # seconds of a lend's 15 minutes the lane may take on a GPU (start-up and a rerun take the rest)
CPU_TRIAL_SLACK = 5
MIN_STEP = 15  # a step is not started with less than this left of the budget ("skipped for time")
HOST_BENCHMARK = "host_optimizer.py"  # benchmarks/host_optimizer.py: its step is skipped where absent
# offload.py's settings in the lane (its full set takes half as long again): the cost of 25/50/100%
# against 0% and 0% + recompute, optimizer-only offload, and the host step started in backward
# against no offload (both without clipping, which that start needs)
OFFLOAD_SETTINGS = "0%,0% + recompute,25%,50%,100%,50% optim only,0% noclip,50% in backward"


@dataclass(frozen=True)
class Plan:
    """One step of the lane, in the order a user meets what it checks. ``limit``: seconds on a GPU
    (the step is killed after it); ``gpu_work``: the seconds it is assumed to spend on the GPU
    beyond what its CPU dry run spends (CUDA and NCCL start-up, the GPU-sized shapes, inductor's
    compilation) — an assumption until a GPU run replaces it (``--estimate``)."""

    name: str
    limit: int
    gpu_work: int
    tests: tuple = ()  # tests/cuda modules (a pytest step) ...
    bench: str = ""  # ... or a benchmark script
    what: str = ""


STEPS = [
    Plan("environment", 20, 5, what="torch, CUDA, NCCL, nvidia-smi; decides CUDA or CPU trial"),
    Plan(
        "train",
        70,
        25,
        ("test_numerics.py", "test_multirank.py", "test_profiling.py"),
        what="one rank, --bf16 with the default flags then fp32, vs CPU; 2 ranks with gloo over CUDA tensors; "
        "the profiler flags (CUDA kernels in the trace, the nsys range, the memory snapshot)",
    ),
    Plan(
        "offload",
        105,
        60,
        ("test_offload.py", "test_host_paths.py"),
        what="offloaded layers: memory vs the planner, prefetch overlap, pinned 16-bit D2H gradients, host step "
        "in backward, delayed update, NVMe tier, optimizer-only offload",
    ),
    Plan(
        "checkpoint",
        55,
        25,
        ("test_resume.py", "test_checkpoint.py"),
        what="bitwise resume with the CUDA RNG, --async-save's D2H copy, the memory preflight",
    ),
    Plan(
        "moe",
        45,
        10,
        ("test_moe.py",),
        what="NCCL all-to-all dispatch, --moe-grouped-gemm, the expert bias and shared experts",
    ),
    Plan(
        "kernels",
        90,
        60,
        ("test_kernels.py", "test_context.py"),
        what="SDPA flash/efficient with dropout, fp16 loss scaling, precision-aware fused AdamW, multi-latent "
        "attention, context parallelism's block kernel and sink-aware SDPA, --compile",
    ),
    Plan("planner", 50, 20, ("test_planner_memory.py",), what="the planner's activations vs the CUDA allocator"),
    Plan("mfu", 75, 60, bench="mfu.py", what="MFU of a 1B-class bf16 model at seq 4096"),
    Plan("step_throughput", 65, 40, bench="step_throughput.py", what="our step vs plain PyTorch and HF GPT-2"),
    Plan(
        "offload_speed",
        120,
        90,
        bench="offload.py",
        what="step time with 0-100% of layers offloaded, and the host step started in backward",
    ),
    Plan("host_optimizer", 25, 15, bench=HOST_BENCHMARK, what="the host step's kernels vs a triad (host benchmark)"),
]
PLANS = {p.name: p for p in STEPS}
TEST_STEPS = [p.name for p in STEPS if p.tests]


@dataclass
class Step:
    name: str
    argv: List[str]
    timeout: float
    figures_file: Optional[str] = None  # the JSON the step writes
    env: Dict[str, str] = field(default_factory=dict)
    skip: str = ""  # why the step cannot run here (reported as skipped)


def environment_step(out: str) -> Step:
    path = os.path.join(out, "environment.json")
    return Step(
        "environment",
        [sys.executable, os.path.abspath(__file__), "--environment", path],
        PLANS["environment"].limit,
        path,
    )


def _bench_args(name: str, cuda: bool, out: str) -> List[str]:
    """A benchmark's flags: the GPU's sizes, or the CPU trial's smallest with every other flag as
    on the GPU (so a renamed flag fails the trial too)."""
    device = ["--device", "cuda" if cuda else "cpu"]
    sized = {
        "mfu": device + ([] if cuda else ["--tiny"]),
        "step_throughput": ["--bf16", *device] + ([] if cuda else ["--tiny", "--steps", "1", "--rounds", "1"]),
        "offload_speed": ["--bf16", *device, "--settings", OFFLOAD_SETTINGS]
        + (["--shape", "gpu", "--steps", "2"] if cuda else ["--shape", "micro", "--steps", "1"]),
        "host_optimizer": ["--repeats", "3"] if cuda else ["--quick"],
    }[name]
    return sized + ["--json", os.path.join(out, f"{name}.json")]


def plan_steps(out: str, cuda: bool, dry_run_tests: bool) -> List[Step]:
    """The steps after ``environment``, in order: for a CUDA machine, or their CPU-sized trial. A
    trial's limits are ``CPU_TRIAL_SLACK`` times longer (they stop a hang, not a slow shared CPU),
    and its steps run one thread each unless OMP_NUM_THREADS says otherwise: its figures check the
    code, not the CPU, and idle threads spinning against other load cost it minutes."""
    py = sys.executable
    threads = {} if cuda or "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    tests_env = {"P2R_GPU_ARTIFACTS": out, **threads, **({"P2R_CUDA_DRY_RUN": "1"} if dry_run_tests else {})}
    steps = []
    for plan in STEPS[1:]:
        limit = plan.limit * (1 if cuda else CPU_TRIAL_SLACK)
        if plan.tests:
            junit = os.path.join(out, f"junit_{plan.name}.xml")
            steps.append(
                Step(
                    plan.name,
                    [
                        py,
                        "-m",
                        "pytest",
                        "-q",
                        "-rA",
                        "-p",
                        "no:cacheprovider",
                        "-o",
                        "junit_family=xunit1",
                        "-o",
                        f"timeout={plan.limit}",
                        "--junitxml",
                        junit,
                        *(f"tests/cuda/{m}" for m in plan.tests),
                    ],
                    limit,
                    env=tests_env,
                )
            )
            continue
        script = os.path.join(ROOT, "benchmarks", plan.bench)
        missing = "" if os.path.exists(script) else f"benchmarks/{plan.bench} is not in this checkout"
        steps.append(
            Step(
                plan.name,
                [py, script, *_bench_args(plan.name, cuda, out)],
                limit,
                os.path.join(out, f"{plan.name}.json"),
                threads,
                skip=missing,
            )
        )
    return steps


def estimate(report: dict) -> List[dict]:
    """The lane's schedule on a GPU estimated from a CPU dry run's report: per step, the seconds
    the dry run took (measured: everything but the GPU's work, on that CPU) plus the GPU work
    assumed in ``STEPS``, against the step's limit, and when each step ends at the latest."""
    seconds = {s["name"]: s["seconds"] for s in report.get("steps", [])}
    rows, by = [], 0
    for plan in STEPS:
        measured = seconds.get(plan.name)
        by += plan.limit
        est = None if measured is None else round(measured + plan.gpu_work, 1)
        rows.append(
            {
                "step": plan.name,
                "limit": plan.limit,
                "by": by,
                "dry_run_s": measured,
                "gpu_work_s": plan.gpu_work,
                "estimate_s": est,
                "fits": est is not None and est <= plan.limit,
            }
        )
    return rows


def print_estimate(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        report = json.load(fh)
    rows = estimate(report)
    print(
        f"The lane on a GPU, estimated from the CPU dry run in {path} ({report.get('mode', '?')}, host "
        f"{(report.get('environment') or {}).get('host', '?')}): dry run = measured there, GPU work = assumed."
    )
    print("| by | step | limit s | dry run s | + GPU work s | estimate s | fits |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['by'] // 60}:{r['by'] % 60:02d} | {r['step']} | {r['limit']} | {r['dry_run_s']} | "
            f"{r['gpu_work_s']} | {r['estimate_s']} | {'yes' if r['fits'] else 'NO'} |"
        )
    total = sum(r["estimate_s"] or 0 for r in rows)
    print(f"limits {sum(p.limit for p in STEPS)} s of the {BUDGET} s budget; estimate {total:.0f} s")
    return 0 if all(r["fits"] for r in rows) and sum(p.limit for p in STEPS) <= BUDGET else 1


# ----------------------------------------------------------------------------- running


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def skipped_step(step: Step, why: str) -> dict:
    return {
        "name": step.name,
        "status": "skipped",
        "returncode": None,
        "seconds": 0.0,
        "timeout": step.timeout,
        "command": " ".join(step.argv),
        "figures": None,
        "log_tail": why,
        "skipped": why,
    }


def run_step(step: Step, out: str) -> dict:
    """Run one step in its own process group with its time limit; its result for the report."""
    if step.skip:
        return skipped_step(step, step.skip)
    log_path = os.path.join(out, f"{step.name}.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=step.timeout)
            # pytest's 5: nothing collected — every module of tests/cuda skipped itself (no GPU)
            status = (
                {0: "passed", 5: "skipped"}.get(returncode, "failed")
                if step.name in TEST_STEPS
                else ("passed" if returncode == 0 else "failed")
            )
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode, status = None, "timeout"
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        log_text = fh.read()
    figures = None
    if step.figures_file and os.path.exists(step.figures_file):
        with open(step.figures_file, encoding="utf-8") as fh:
            figures = json.load(fh)
    return {
        "name": step.name,
        "status": status,
        "returncode": returncode,
        "seconds": round(time.monotonic() - start, 1),
        "timeout": step.timeout,
        "command": " ".join(step.argv),
        "figures": figures,
        "log_tail": "\n".join(log_text.splitlines()[-40:]),
    }


def junit_results(path: str) -> List[dict]:
    """Every test case of a junit XML file: outcome, seconds, first line of the message, and the
    figures it recorded with ``record_property`` (Python literals where they parse)."""
    if not os.path.exists(path):
        return []
    out = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                text = (node.get("message") or node.text or "").strip()
                outcome, message = name, text.splitlines()[0][:300] if text else ""
                break
        figures = {}
        for prop in case.iter("property"):
            try:
                figures[prop.get("name")] = ast.literal_eval(prop.get("value"))
            except (ValueError, SyntaxError):
                figures[prop.get("name")] = prop.get("value")
        name = "::".join(x for x in (case.get("classname"), case.get("name")) if x)
        out.append(
            {
                "test": name,
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
                "figures": figures,
            }
        )
    return out


# ----------------------------------------------------------------------------- environment


def _write_json(path: str, info: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1, default=str)


def describe_environment(path: str) -> None:
    """The ``environment`` step (its own process: importing torch may fail or hang). Whether CUDA
    is there is written first: the lane's mode depends on it, the details must not."""
    import torch

    info = {
        "python": sys.version.split()[0],
        "host": platform.node(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
    }
    _write_json(path, info)
    try:
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            info.update(
                device=props.name,
                capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=props.multi_processor_count,
            )
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as exc:  # noqa: BLE001 — a detail that cannot be read is reported, not fatal
        info["environment_error"] = repr(exc)
    print(json.dumps(info, indent=1, default=str))
    _write_json(path, info)


# ----------------------------------------------------------------------------- report


def targets(steps: Dict[str, dict], cuda: bool) -> List[dict]:
    """The lane's two performance targets, met or not (None when not measured on a GPU)."""
    mfu = (steps.get("mfu", {}).get("figures") or {}).get("mfu")
    offload = (steps.get("offload_speed", {}).get("figures") or {}).get("settings", {}).get("50%", {})
    cost = offload["vs_0"] - 1 if offload else None
    cost_rc = offload["vs_0_recompute"] - 1 if offload else None
    return [
        {
            "target": "MFU, bf16, 1B-class stack, seq 4096",
            "goal": f">= {TARGETS['mfu']:.0%}",
            "value": mfu,
            "met": (mfu >= TARGETS["mfu"]) if cuda and mfu is not None else None,
        },
        {
            "target": "offload of 50% of layers: step time cost at prefetch 1 (vs 0%)",
            "goal": f"<= {TARGETS['offload_50']:.0%}",
            "value": cost,
            "vs_recompute_baseline": cost_rc,
            "met": (cost <= TARGETS["offload_50"]) if cuda and cost is not None else None,
        },
    ]


def _percent(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _flops(x: float) -> str:
    """FLOP/s in TFLOP/s on a GPU, GFLOP/s in the CPU trial (where TFLOP/s would print 0.0)."""
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def figure_lines(steps: Dict[str, dict]) -> List[str]:
    """The benchmarks' headline figures (report.json holds all of them)."""
    lines = []
    mfu = steps.get("mfu", {}).get("figures")
    if mfu:
        lines += [
            "",
            "## MFU (benchmarks/mfu.py)",
            "",
            f"{_parameters(mfu['parameters'])} parameters, {mfu['layers']} layers of hidden {mfu['hidden']}, "
            f"seq {mfu['seq']}, {mfu['tokens_per_step']} tokens per step: step {1000 * mfu['step_s']:.1f} ms, "
            f"{mfu['tokens_per_s']:,.0f} tokens/s, {_flops(mfu['achieved_flops'])} of model FLOPs; "
            f"MFU {_percent(mfu['mfu'])} ({_percent(mfu['mfu_without_attention_flops'])} without attention "
            f"FLOPs); {_percent(mfu['fraction_of_ceiling'])} of the measured matmul ceiling "
            f"({_flops(mfu['matmul_ceiling_flops'])}).",
        ]
    offload = steps.get("offload_speed", {}).get("figures")
    if offload:
        title = f"Offload (benchmarks/offload.py, shape {offload['shape']}, prefetch {offload['prefetch']})"
        lines += [
            "",
            f"## {title}",
            "",
            "| setting | layers on host | ms/step | vs 0% | vs 0% + recompute | CUDA peak GiB |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in offload["settings"].items():
            peak = f"{r['cuda_peak'] / 2**30:.2f}" if "cuda_peak" in r else "-"
            lines.append(
                f"| {label} | {r['layers']} | {r['ms_per_step']:.1f} | {r['vs_0']:.2f} | "
                f"{r['vs_0_recompute']:.2f} | {peak} |"
            )
        lines += [""] + [f"- {says}: {ratio:.2f}" for says, ratio in offload.get("ratios", {}).items()]
    host = steps.get("host_optimizer", {}).get("figures")
    if host and host.get("results"):
        threads = max(host["triad_gbs"], key=int)
        rows = [r for r in host["results"] if str(r["threads"]) == threads]
        lines += [
            "",
            f"## Host optimizer step (benchmarks/{HOST_BENCHMARK}, {host.get('cpu', '?')})",
            "",
            f"{threads} threads: triad {host['triad_gbs'][threads]:.1f} GB/s; "
            + "; ".join(
                f"{r['name']} {r['ns_per_element']:.2f} ns/element ({r['ratio_to_triad']:.2f}x its "
                "traffic at the triad's bandwidth)"
                for r in rows
            ),
        ]
    throughput = steps.get("step_throughput", {}).get("figures")
    if throughput:
        rates = ", ".join(f"{k} {v:,.0f}" for k, v in throughput["tokens_per_s"].items())
        ratio = throughput["ratio_ours_over_hf"]
        lines += [
            "",
            "## Step throughput (benchmarks/step_throughput.py)",
            "",
            f"{throughput['dtype']} on {throughput['device']}: tokens/s {rates}"
            + (f"; ours / HF {ratio:.2f}x" if ratio else "")
            + f"; ours at {_percent(throughput['fraction_of_ceiling'])} of the matmul ceiling.",
        ]
    return lines


def render_markdown(report: dict, logs: bool = True) -> str:
    """The report as Markdown; ``logs`` adds the log tails of the steps that did not pass."""
    env = report.get("environment") or {}
    lines = [
        f"# GPU lane report ({report['mode']})",
        "",
        f"Started {report['started']}, finished {report.get('finished', '(running)')}; "
        f"{env.get('device', 'no CUDA device')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda_build')}), "
        f"NCCL {env.get('nccl', '-')}, host {env.get('host', '?')}.",
        "",
        f"Budget {report.get('budget_s', BUDGET):.0f} s; {summary_line(report)}.",
        "",
        "| step | checks | status | seconds | limit |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['name']} | {PLANS[s['name']].what if s['name'] in PLANS else ''} | "
        f"{s.get('skipped') or s['status']} | {s['seconds']} | {s['timeout']:.0f} |"
        for s in report["steps"]
    ]
    if report.get("tests"):
        lines += ["", "## Tests (tests/cuda)", "", "| test | outcome | s | figures / message |", "|---|---|---|---|"]
        for t in report["tests"]:
            detail = " — ".join(
                x for x in (json.dumps(t["figures"], default=str) if t["figures"] else "", t["message"]) if x
            ).replace("|", "\\|")
            lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {detail} |")
    lines += ["", "## Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        value = _percent(t["value"])
        if t.get("vs_recompute_baseline") is not None:
            value += f" ({_percent(t['vs_recompute_baseline'])} vs 0% + recompute)"
        lines.append(f"| {t['target']} | {t['goal']} | {value} | {({True: 'yes', False: 'NO'}).get(t['met'], 'n/a')} |")
    lines += figure_lines({s["name"]: s for s in report["steps"]})
    for s in report["steps"] if logs else []:
        if s["status"] != "passed":
            lines += ["", f"## {s['name']}: {s['status']} (log tail)", "", "```", s["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: str) -> None:
    _write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as fh:
        fh.write(render_markdown(report))
    with open(os.path.join(out, "gpu_check.log"), "w", encoding="utf-8") as log:
        for s in report["steps"]:
            path = os.path.join(out, f"{s['name']}.log")
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    log.write(f"===== {s['name']}: {s['status']} ({s['seconds']} s)\n{fh.read()}\n")
    copy_to = os.environ.get("OUT")
    if copy_to and os.path.abspath(copy_to) != os.path.abspath(out):
        os.makedirs(copy_to, exist_ok=True)
        for name in OUT_FILES:
            if os.path.exists(os.path.join(out, name)):
                shutil.copy(os.path.join(out, name), os.path.join(copy_to, name))


# ----------------------------------------------------------------------------- main


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_lane(out: str, only: Optional[List[str]], dry_run_tests: bool, budget: Optional[float] = None) -> dict:
    """Every step in order within ``budget`` seconds (``BUDGET`` on a GPU, ``CPU_TRIAL_SLACK``
    times that in a CPU trial): a step gets its limit or what is left, whichever is less, and is
    skipped for time when less than ``MIN_STEP`` is left; the report says which."""
    started = time.monotonic()
    os.makedirs(out, exist_ok=True)
    report = {
        "lane": "megatron_p2r make gpu-check",
        "started": _now(),
        "mode": "detecting",
        "environment": None,
        "steps": [],
        "tests": [],
        "targets": [],
    }
    env_result = run_step(environment_step(out), out)
    report["steps"].append(env_result)
    report["environment"] = env_result["figures"]
    cuda = bool(env_result["figures"] and env_result["figures"].get("cuda_available"))
    report["mode"] = (
        "cuda"
        if cuda
        else (
            f"cpu-trial (no CUDA device: {'the CUDA tests dry-run on CPU' if dry_run_tests else 'the CUDA tests skip'}, "
            "CPU-sized benchmarks)"
        )
    )
    budget = budget or BUDGET * (1 if cuda else CPU_TRIAL_SLACK)
    report["budget_s"] = budget
    write_report(report, out)
    for step in plan_steps(out, cuda=cuda, dry_run_tests=dry_run_tests):
        if only and step.name not in only:
            continue
        left = budget - (time.monotonic() - started)
        if left < MIN_STEP:
            result = skipped_step(step, f"skipped for time: {max(left, 0):.0f} s of the {budget:.0f} s budget left")
        else:
            step.timeout = min(step.timeout, left)
            print(f"gpu-check: {step.name} (limit {step.timeout:.0f} s) ...", flush=True)
            result = run_step(step, out)
        report["steps"].append(result)
        if step.name in TEST_STEPS:
            report["tests"] += junit_results(os.path.join(out, f"junit_{step.name}.xml"))
        report["targets"] = targets({s["name"]: s for s in report["steps"]}, cuda)
        write_report(report, out)
        print(f"gpu-check: {step.name} {result['status']} in {result['seconds']} s\n{result['log_tail']}\n", flush=True)
    report["finished"] = _now()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = all(lane_ok(s, cuda) for s in report["steps"])
    write_report(report, out)
    return report


def lane_ok(step: dict, cuda: bool) -> bool:
    """A step passed; or, in a CPU trial, its CUDA tests skipped; or the host benchmark is not in
    this checkout yet. A step skipped for time is not ok: the lane did not check it."""
    if step["status"] == "passed":
        return True
    if step["status"] != "skipped" or "skipped for time" in (step.get("skipped") or ""):
        return False
    return not cuda or step["name"] == "host_optimizer"


def summary_line(report: dict) -> str:
    """What ran, what was skipped (for time, or absent), what failed."""
    by = {}
    for s in report["steps"]:
        key = "skipped for time" if "skipped for time" in (s.get("skipped") or "") else s["status"]
        by.setdefault(key, []).append(s["name"])
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in by.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_report", help="report directory (also copied to $OUT when set)")
    parser.add_argument(
        "--only",
        help="comma-separated steps to run (environment always runs; 'tests' is every "
        f"test step: {','.join(TEST_STEPS)}), e.g. offload,mfu",
    )
    parser.add_argument(
        "--dry-run-tests",
        action="store_true",
        help="run the CUDA tests' CPU parts (P2R_CUDA_DRY_RUN=1) instead of skipping them",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds for the whole lane (default {BUDGET} on a GPU, {CPU_TRIAL_SLACK}x that in a CPU trial)",
    )
    parser.add_argument(
        "--estimate",
        metavar="REPORT_JSON",
        help="print the GPU schedule estimated from a CPU dry run's report.json, and exit",
    )
    parser.add_argument("--environment", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.environment:
        describe_environment(args.environment)
        return 0
    if args.estimate:
        return print_estimate(args.estimate)
    only = None
    if args.only:
        only = [n for name in args.only.split(",") for n in (TEST_STEPS if name == "tests" else [name])]
        unknown = sorted(set(only) - set(PLANS))
        if unknown:
            print(
                f"error: --only {args.only}: unknown steps {unknown}; expected some of tests,{','.join(PLANS)}",
                file=sys.stderr,
            )
            return 2
    report = run_lane(os.path.abspath(args.out), only, args.dry_run_tests, args.budget)
    print(render_markdown(report, logs=False))
    print(
        f"gpu-check: {'ok' if report['ok'] else 'NOT OK'} ({summary_line(report)}); "
        f"{report['seconds']} s; report in {os.path.abspath(args.out)}"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
