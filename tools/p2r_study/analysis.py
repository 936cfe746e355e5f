"""The analysis of the Pseudo-to-Real convergence study, as pure functions of saved records, so
the report can be rebuilt from the logs (``p2r-study --report-only``) and checked on
synthetic curves with a known answer (tests/tools/p2r_study/test_analysis.py).

A *run* is one arm trained with one seed:
``{"model", "arm", "seed", "phases": [{"kind", "start", "end", "flops_per_token"}], "points": [[step, loss, se]],
"final_losses": [per held-out sample]}`` (points in training order, se the loss's standard error over
the held-out samples; a conversion adds a second point at its step). Costs are piecewise
linear in steps: a phase's steps cost its FLOPs per token times the tokens per step, and its
measured step time (``timing[kind]`` in seconds, from a separate interleaved timing run).

Comparisons are *paired*: each seed's target is the final held-out loss of real-from-scratch
with that seed (same initialisation seed, same data order, same held-out set), and an arm's
cost to reach it is divided by that scratch run's own cost to reach it.
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Sequence

from tools.p2r_study.heldout import clustered_se, paired_se
from megatron_p2r.planning.breakeven import break_even_extra_steps

BUDGET = "@budget"  # a kind's suffix: the same phase run under --device-memory-budget


def crossing_step(points: Sequence[Sequence[float]], target: float) -> Optional[float]:
    """The first step at which the curve reaches ``target`` (linear between evaluations), or None."""
    for i, (step, loss, *_) in enumerate(points):
        if loss <= target:
            if i == 0:
                return float(step)
            s0, l0 = points[i - 1][:2]
            return s0 + (step - s0) * (l0 - target) / (l0 - loss) if l0 != loss else float(step)
    return None


def cost_until(step: float, phases: Sequence[dict], per_step: Callable[[dict], float]) -> float:
    """The summed cost of every phase's steps up to ``step``."""
    return sum(max(0.0, min(step, p["end"]) - p["start"]) * per_step(p) for p in phases)


def costs_to(step: float, phases: Sequence[dict], tokens_per_step: int, timing: Dict[str, float]) -> dict:
    """Steps, training FLOPs and wall seconds (real model fits; real model under the memory
    budget) that a run spends up to ``step``; a wall time whose step times were not measured
    is left out."""
    out = {"steps": step, "flops": cost_until(step, phases, lambda p: p["flops_per_token"] * tokens_per_step)}
    for key, suffix in (("wall", ""), ("wall_budget", BUDGET)):
        if all(p["kind"] + suffix in timing for p in phases):
            out[key] = cost_until(step, phases, lambda p, s=suffix: timing[p["kind"] + s])
    return out


def mean_std(values: Sequence[float]) -> tuple:
    """(mean, sample std) — std 0 for a single value."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: Sequence[float], digits: int = 3) -> str:
    """mean ± std over seeds; a value the seeds share (or a single seed's) without the ± 0."""
    if not values:
        return "-"
    m, s = mean_std(values)
    return f"{m:.{digits}f}" if f"{s:.{digits}f}" == f"{0:.{digits}f}" else f"{m:.{digits}f} ± {s:.{digits}f}"


def seed_se(values: Sequence[float]) -> Optional[float]:
    """The standard error of a mean over seeds (None for one seed): how far another set of seeds
    (other initialisations and data orders) could move it."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def _document_se(a: Sequence[float], b: Sequence[float], documents: Optional[Sequence[int]]) -> Optional[float]:
    return clustered_se(a, b, documents) if documents is not None and len(documents) == len(a) else None


def early_phases(run: dict, timing: Dict[str, float], real_kind: str, suffix: str = BUDGET) -> List[tuple]:
    """(steps, r) of each phase before the last (the real model), r = real step time / its step time."""
    real = timing[real_kind + suffix]
    return [(p["end"] - p["start"], real / timing[p["kind"] + suffix]) for p in run["phases"][:-1]]


def paired(
    runs: Sequence[dict],
    timing: Dict[str, float],
    tokens_per_step: Dict[str, int],
    scratch_arm: str,
    documents: Optional[Sequence[int]] = None,
) -> Dict[tuple, dict]:
    """(model, arm) -> per-seed figures against that seed's scratch run: final loss, its standard
    error on the held-out set, its difference from scratch's and that difference's paired standard
    error (and document-clustered, given each held-out sample's ``documents``); cost-to-target ratios (None where the target is not reached) and the FLOPs ratio a
    crossing at the arm's last step would score (what its cheaper phases alone give); the
    break-even under the memory budget (allowed extra steps, measured extra steps)."""
    scratch = {(r["model"], r["seed"]): r for r in runs if r["arm"] == scratch_arm}
    out: Dict[tuple, dict] = {}
    for run in runs:
        base = scratch[(run["model"], run["seed"])]
        target = base["points"][-1][1]
        tps = tokens_per_step[run["model"]]
        base_cost = costs_to(crossing_step(base["points"], target), base["phases"], tps, timing)
        step = crossing_step(run["points"], target)
        cost = costs_to(step, run["phases"], tps, timing) if step is not None else None
        entry = out.setdefault(
            (run["model"], run["arm"]),
            {
                "seeds": [],
                "final": [],
                "se": [],
                "delta": [],
                "delta_se": [],
                "delta_dse": [],
                "ratios": {},
                "last_step_flops": [],
                "allowed": [],
                "extra": [],
            },
        )
        entry["seeds"].append(run["seed"])
        entry["final"].append(run["points"][-1][1])
        entry["se"].append(run["points"][-1][2])
        entry["delta"].append(run["points"][-1][1] - target)
        entry["delta_se"].append(paired_se(run["final_losses"], base["final_losses"]))
        entry["delta_dse"].append(_document_se(run["final_losses"], base["final_losses"], documents))
        for key in base_cost:
            entry["ratios"].setdefault(key, []).append(None if cost is None else cost[key] / base_cost[key])
        last = costs_to(run["points"][-1][0], run["phases"], tps, timing)
        entry["last_step_flops"].append(last["flops"] / base_cost["flops"])
        real_kind = base["phases"][-1]["kind"]
        if real_kind + BUDGET in timing:
            entry["allowed"].append(break_even_extra_steps(early_phases(run, timing, real_kind)))
        entry["extra"].append(None if step is None else step - base_cost["steps"])
    return out


def matched(
    runs: Sequence[dict], control_of: Callable[[str], Optional[str]], documents: Optional[Sequence[int]] = None
) -> Dict[tuple, dict]:
    """(model, arm) -> the arm's final loss minus that of its compute-matched control (the run
    ``control_of(arm)`` names), per seed, with the paired (and document-clustered) standard error."""
    by_key = {(r["model"], r["arm"], r["seed"]): r for r in runs}
    out: Dict[tuple, dict] = {}
    for run in runs:
        control = by_key.get((run["model"], control_of(run["arm"]), run["seed"]))
        if control is None:
            continue
        entry = out.setdefault((run["model"], run["arm"]), {"seeds": [], "delta": [], "delta_se": [], "delta_dse": []})
        entry["seeds"].append(run["seed"])
        entry["delta"].append(run["points"][-1][1] - control["points"][-1][1])
        entry["delta_se"].append(paired_se(run["final_losses"], control["final_losses"]))
        entry["delta_dse"].append(_document_se(run["final_losses"], control["final_losses"], documents))
    return out


def wins(ratios: Sequence[Optional[float]], threshold: float) -> bool:
    """Every seed reached the target at no more than ``threshold`` of scratch's cost."""
    return bool(ratios) and all(r is not None and r <= threshold for r in ratios)


def ratio_cell(ratios: Sequence[Optional[float]]) -> str:
    reached = [r for r in ratios if r is not None]
    cell = fmt(reached, 2)
    missing = len(ratios) - len(reached)
    return cell + (f" ({missing}/{len(ratios)} seeds never reach it)" if missing else "")


def difference_curve(run: dict, scratch: dict) -> tuple:
    """(steps, the run's held-out loss minus scratch's at each of its evaluations): scratch's curve
    is linear between its evaluations, so a conversion's extra point is compared too."""
    import numpy as np

    steps = [p[0] for p in run["points"]]
    base = np.interp(steps, [p[0] for p in scratch["points"]], [p[1] for p in scratch["points"]])
    return steps, [p[1] - b for p, b in zip(run["points"], base, strict=True)]


def band(curves: Sequence[tuple], arm: str = "") -> tuple:
    """(steps, mean, std) over the seeds' (steps, values) curves of one arm (their grids are equal)."""
    if any(c[0] != curves[0][0] for c in curves):
        raise ValueError(f"arm {arm!r}: seeds were evaluated at different steps")
    stats = [mean_std(column) for column in zip(*[c[1] for c in curves], strict=True)]
    return curves[0][0], [m for m, _ in stats], [s for _, s in stats]
