"""The convergence study's report: docs/results.md (tables of mean ± std over seeds, paired
ratios, timing, break-even, a plain verdict) and the plot with error bands, written from the
saved records and timing by ``p2r_convergence.py`` (also with ``--report-only``)."""
from __future__ import annotations

import os
from typing import Dict, List

from benchmarks.p2r_analysis import BUDGET, band, cost_until, fmt, paired, ratio_cell, wins

SCRATCH = "real from scratch"
TARGET_RATIO = 0.8
SCENARIOS = (("flops", "training FLOPs"), ("wall", "wall time, real model fits"),
             ("wall_budget", "wall time, real model under the memory budget"))


def _arms_in_order(records: List[dict], arms: dict, model: str) -> List[str]:
    present = {r["arm"] for r in records if r["model"] == model}
    return [a for a in arms[model] if a in present]


def _results_table(stats: Dict[tuple, dict], model: str, order: List[str]) -> List[str]:
    lines = ["| arm | seeds | final eval loss | Δ vs scratch (paired) | steps to target | FLOPs to target | "
             "wall to target (fits) | wall to target (budget) |", "|---|---|---|---|---|---|---|---|"]
    for arm in order:
        e = stats[(model, arm)]
        r = e["ratios"]
        lines.append(f"| {arm} | {len(e['seeds'])} | {fmt(e['final'])} | {fmt(e['delta'])} | "
                     f"{ratio_cell(r['steps'])} | {ratio_cell(r['flops'])} | {ratio_cell(r['wall'])} | "
                     f"{ratio_cell(r['wall_budget'])} |")
    return lines


def _timing_table(timing: dict, models: dict, kinds: List[str]) -> List[str]:
    med = timing["median_s"]
    lines = ["| phase kind (model/layers/share pattern) | ms per step | ms per step under the budget "
             "(layers offloaded) | real ÷ this | real ÷ this, under the budget |", "|---|---|---|---|---|"]
    for kind in kinds:
        model = kind.split("/")[0]
        real = f"{model}/{models[model]['layers']}L/none"
        lines.append(f"| {kind} | {1000 * med[kind]:.0f} | {1000 * med[kind + BUDGET]:.0f} "
                     f"({timing['offloaded_layers'][kind]}) | {med[real] / med[kind]:.2f} | "
                     f"{med[real + BUDGET] / med[kind + BUDGET]:.2f} |")
    return lines


def _break_even_table(stats: Dict[tuple, dict], model: str, order: List[str]) -> List[str]:
    lines = ["| arm | extra steps it may need and still break even (Δ*) | extra steps it needed (D) | "
             "pays under the budget in every seed |", "|---|---|---|---|"]
    for arm in order:
        if arm == SCRATCH:
            continue
        e = stats[(model, arm)]
        reached = [d for d in e["extra"] if d is not None]
        pays = len(reached) == len(e["extra"]) and all(d <= a for d, a in zip(e["extra"], e["allowed"], strict=True))
        missing = len(e["extra"]) - len(reached)
        note = f" ({missing}/{len(e['extra'])} seeds never reach the target)" if missing else ""
        lines.append(f"| {arm} | {fmt(e['allowed'], 1)} | {fmt(reached, 1)}{note} | {'yes' if pays else 'no'} |")
    return lines


def verdicts(stats: Dict[tuple, dict], models: List[str], order: Dict[str, List[str]]) -> List[str]:
    """Plain statements: which arm reaches scratch's final loss with <= 0.8x its cost in every
    seed, per scenario; and the best figure otherwise."""
    lines = []
    for model in models:
        for key, what in SCENARIOS:
            winners = [a for a in order[model] if a != SCRATCH and wins(stats[(model, a)]["ratios"][key], TARGET_RATIO)]
            if winners:
                lines.append(f"- **{model}, {what}: target met** by {', '.join(winners)} "
                             f"(≤ {TARGET_RATIO}x of scratch's cost in every seed).")
                continue
            best = min((a for a in order[model] if a != SCRATCH), key=lambda a: _rank(stats[(model, a)]["ratios"][key]))
            lines.append(f"- {model}, {what}: target **not met**; the best arm, {best}, "
                         f"{_describe(stats[(model, best)]['ratios'][key])}.")
    return lines


def _rank(ratios) -> tuple:
    """Fewest seeds that never reach the target first, then the lowest worst ratio."""
    reached = [r for r in ratios if r is not None]
    return len(ratios) - len(reached), max(reached, default=float("inf"))


def _describe(ratios) -> str:
    missing, worst = _rank(ratios)
    parts = [f"never reaches the target in {missing} of {len(ratios)} seeds"] if missing else []
    if missing < len(ratios):
        parts.append(f"{'where it does, it ' if missing else ''}needs up to {worst:.2f}x of scratch's cost")
    return "; ".join(parts)


def plot(records: List[dict], timing: dict, models: List[str], order: Dict[str, List[str]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    med = timing["median_s"]
    axes_x = [("steps", lambda p, tps: 1.0), ("training FLOPs", lambda p, tps: p["flops_per_token"] * tps),
              ("wall s (real fits)", lambda p, tps: med[p["kind"]]),
              ("wall s (real under budget)", lambda p, tps: med[p["kind"] + BUDGET])]
    fig, axes = plt.subplots(len(models), len(axes_x), figsize=(15, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for arm in order[model]:
            runs = [r for r in records if r["model"] == model and r["arm"] == arm]
            steps, mean, std = band(runs)
            phases, tps = runs[0]["phases"], runs[0]["tokens_per_step"]
            for col, (label, per_step) in enumerate(axes_x):
                x = [cost_until(s, phases, lambda p: per_step(p, tps)) for s in steps]
                ax = axes[row][col]
                line, = ax.plot(x, mean, label=f"{arm} ({len(runs)} seeds)", lw=1.2)
                low = [m - s for m, s in zip(mean, std, strict=True)]
                high = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, lw=0)
                ax.set_xlabel(label)
        axes[row][0].set_ylabel(f"{model}: validation loss")
        axes[row][0].legend(fontsize=7.5, loc="upper right")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            low = min(min(p[1] for p in r["points"]) for r in records if r["model"] == model)
            ax.set_ylim(low - 0.1, low + 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    from PIL import Image  # matplotlib's own dependency: a 128-colour palette keeps the committed PNG small
    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)


def write(records: List[dict], timing: dict, args, arms: dict, models: dict, out: str) -> None:
    """docs/results.md and docs/p2r_convergence.png from the study's records."""
    present = [m for m in models if any(r["model"] == m for r in records)]
    tps = {r["model"]: r["tokens_per_step"] for r in records}
    stats = paired(records, timing["median_s"], tps, SCRATCH)
    order = {m: _arms_in_order(records, arms, m) for m in present}
    seeds = sorted({r["seed"] for r in records})
    lines = [
        "# Pseudo-to-Real and depth growth at small scale: does it pay?", "",
        f"Measured by `python benchmarks/p2r_convergence.py --iters {args.iters} --seeds "
        f"{' '.join(map(str, seeds))}` on this project's 2-core CPU machine (shared with other sessions; every "
        f"training run on one thread). Demo corpus (Python stdlib source), SentencePiece BPE vocab 4000, seq "
        f"{args.seq}, micro-batch {args.micro_batch} ({args.seq * args.micro_batch} tokens per step), "
        f"SwiGLU/RMSNorm/rotary, AdamW, LR {args.lr:g} cosine to {args.lr / 10:g} over all {args.iters} steps "
        "(one schedule for every phase of a run). Models: "
        + "; ".join(f"**{m}** {models[m]['layers']} layers x hidden {models[m]['hidden']}" for m in present)
        + ". The runs' records (evaluation points, phases) and the timing are kept under `--work`; "
        "`--report-only` rebuilds this page and the plot from them.",
        "",
        f"**How it is measured.** Each arm runs with every seed; a seed fixes initialisation and data order, "
        f"so comparisons are paired: seed s's *target* is the final validation loss of real-from-scratch with "
        f"seed s, and an arm's cost to reach it (linear between evaluations every {args.eval_interval} steps) is "
        f"divided by that scratch run's own. Validation: one fixed held-out set for every run ({args.eval_iters} "
        f"batches of the validation split drawn with seed 1234), evaluated from checkpoints saved every "
        f"{args.eval_interval} steps and right after each conversion. FLOPs count each phase's own model "
        "(a grown model's early phase is cheaper per token; a pseudo model costs the same FLOPs as the real one). "
        "**Wall time is not the runs' own** (the machine is shared): each phase kind's step time was measured "
        f"in a separate timing run, {timing['rounds']} interleaved rounds of {timing['steps']} steps after "
        f"{timing['warmup']} warm-up steps, median, and wall time to a target is steps x that step time. "
        "Two scenarios: the real model fits in device memory, and the paper's: the real model under "
        f"`--device-memory-budget` ({', '.join(f'{m} {b}' for m, b in timing['budget'].items())}) that forces "
        "granular offload with recomputation, while the pseudo model and the shallow model of growth fit. On this "
        "CPU machine 'offload' is a memory copy plus recomputation; on GPUs the transfer is over PCIe, so "
        "r there comes from `tools/plan.py`.", ""]
    for model in present:
        lines += [f"## {model}: {models[model]['layers']} layers x hidden {models[model]['hidden']}", "",
                  "Ratios are the arm's cost to reach the target over scratch's, mean ± std over seeds "
                  "(lower is better; the target is ≤ 0.8).", ""]
        lines += _results_table(stats, model, order[model]) + [""]
        lines += ["Break-even under the memory budget: P2R may need Δ* = Σ early steps x (1 − 1/r) more "
                  "steps than scratch and still finish no later (`megatron_p2r/planning/breakeven.py`).", ""]
        lines += _break_even_table(stats, model, order[model]) + [""]
    kinds = sorted({p["kind"] for r in records for p in r["phases"]})
    lines += ["## Step time per phase kind (timing run)", ""] + _timing_table(timing, models, kinds) + [""]
    lines += ["## Verdict", ""] + verdicts(stats, present, order) + [""]
    if getattr(args, "note", ""):
        lines += [args.note, ""]
    lines += ["![validation loss, mean ± std over seeds](p2r_convergence.png)", ""]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    plot(records, timing, present, order, os.path.join(out, "p2r_convergence.png"))
    print("\n".join(lines))
