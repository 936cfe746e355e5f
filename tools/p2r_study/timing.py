"""The convergence study's timing run: each phase kind's step time measured in isolation, the
kinds interleaved round by round so that load from other processes on a shared machine hits all
of them alike; with a model's memory budget also under ``--device-memory-budget`` (the paper's
scenario: the real model offloads layers, with recomputation, while the pseudo model fits)."""

from __future__ import annotations

import json
import os
import statistics
from typing import Dict, List, Tuple

from tools.p2r_study.analysis import BUDGET
from tools.p2r_study.arms import Phase
from tools.p2r_study.runs import kind_of, model_values, phase_values


def timing_kinds(args) -> Dict[str, Tuple[str, Phase]]:
    return {kind_of(args, m, p): (m, p) for m in args.models for arm in args.arms[m].values() for p in arm}


def measure_steps(args, values: dict, log: str) -> List[float]:
    """Seconds per step of the steps after --timing-warmup, from the training log."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.training import pretrain

    if os.path.exists(log):
        os.remove(log)
    pretrain(
        config_from_values(
            dict(values, train_iters=args.timing_warmup + args.timing_steps, log_interval=1, log_file=log)
        )
    )
    with open(log) as fh:
        records = [json.loads(line) for line in fh]
    return [r["ms_per_iter"] / 1000 for r in records if "ms_per_iter" in r and r["iteration"] > args.timing_warmup]


def timing_run(args) -> dict:
    """Every phase kind, with and without its model's memory budget, round-robin for --timing-rounds."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.layout.plan import ParallelPlan

    samples: Dict[str, List[float]] = {}
    offloaded = {}
    log = os.path.join(args.work, "timing.jsonl")
    for _ in range(args.timing_rounds):
        for kind, (model, phase) in timing_kinds(args).items():
            values = phase_values(args, model, phase, seed=1)
            samples.setdefault(kind, []).extend(measure_steps(args, values, log))
            budget = args.shapes[model].budget
            if budget is None:
                continue
            limited = dict(values, cpu_offload_layers="auto", device_memory_budget=budget)
            samples.setdefault(kind + BUDGET, []).extend(measure_steps(args, limited, log))
            cfg = config_from_values(model_values(limited, args.vocab_size))
            offloaded[kind] = len(ParallelPlan.model_parallel(cfg).stages[0].offloaded)
    return {
        "median_s": {k: statistics.median(v) for k, v in samples.items()},
        "samples_s": samples,
        "offloaded_layers": offloaded,
        "budget": {m: args.shapes[m].budget for m in args.models if args.shapes[m].budget},
        "warmup": args.timing_warmup,
        "steps": args.timing_steps,
        "rounds": args.timing_rounds,
    }
