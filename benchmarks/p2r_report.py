"""The convergence study's report: a markdown page (tables of mean ± std over seeds, paired
ratios, timing, break-even, a plain verdict) and the plot with error bands, written from the
saved records and timing by ``p2r_convergence.py`` (also with ``--report-only``)."""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from benchmarks.p2r_analysis import BUDGET, band, cost_until, fmt, matched, paired, ratio_cell, wins
from benchmarks.p2r_arms import CONTROL_PREFIX, SCRATCH, is_control

TARGET_RATIO = 0.8
SCENARIOS = (("flops", "training FLOPs"), ("wall", "wall time, real model fits"),
             ("wall_budget", "wall time, real model under the memory budget"))


def _arms_in_order(records: List[dict], arms: dict, model: str) -> List[str]:
    present = {r["arm"] for r in records if r["model"] == model}
    return [a for a in arms[model] if a in present]


def _worst(values) -> str:
    return f"{max(values):.3f}" if values else "-"


def _results_table(stats: Dict[tuple, dict], model: str, order: List[str], walls: List[str]) -> List[str]:
    wall_heads = {"wall": "wall to target (fits)", "wall_budget": "wall to target (budget)"}
    heads = ["arm", "seeds", "final held-out loss", "its SE", "Δ vs scratch (paired)", "SE of Δ", "steps to target",
             "FLOPs to target", "FLOPs of a last-step crossing", *(wall_heads[w] for w in walls)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for arm in order:
        e = stats[(model, arm)]
        r = e["ratios"]
        cells = [arm, str(len(e["seeds"])), fmt(e["final"]), _worst(e["se"]), fmt(e["delta"]), _worst(e["delta_se"]),
                 ratio_cell(r["steps"]), ratio_cell(r["flops"]), fmt(e["last_step_flops"], 2),
                 *(ratio_cell(r[w]) for w in walls)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _control_table(controls: Dict[tuple, dict], model: str, order: List[str]) -> List[str]:
    lines = ["| growth arm | its final loss − its control's (paired, mean ± std over seeds) | SE of that difference "
             "(largest over seeds) | lower than its control by more than 2 SE in every seed |", "|---|---|---|---|"]
    for arm in order:
        e = controls.get((model, arm))
        if e is None:
            continue
        lower = all(d < -2 * se for d, se in zip(e["delta"], e["delta_se"], strict=True))
        lines.append(f"| {arm} | {fmt(e['delta'])} | {_worst(e['delta_se'])} | {'yes' if lower else 'no'} |")
    return lines


def _timing_table(timing: dict, shapes: dict, kinds: List[str]) -> List[str]:
    med = timing["median_s"]
    lines = ["| phase kind (model/layers/share pattern) | ms per step | ms per step under the budget "
             "(layers offloaded) | real ÷ this | real ÷ this, under the budget |", "|---|---|---|---|---|"]
    for kind in kinds:
        model = kind.split("/")[0]
        real = f"{model}/{shapes[model].layers}L/none"
        budget = under = "-"
        if kind + BUDGET in med:
            budget = f"{1000 * med[kind + BUDGET]:.0f} ({timing['offloaded_layers'][kind]})"
            under = f"{med[real + BUDGET] / med[kind + BUDGET]:.2f}"
        lines.append(f"| {kind} | {1000 * med[kind]:.0f} | {budget} | {med[real] / med[kind]:.2f} | {under} |")
    return lines


def _break_even_table(stats: Dict[tuple, dict], model: str, order: List[str]) -> List[str]:
    lines = ["| arm | extra steps it may need and still break even (Δ*) | extra steps it needed (D) | "
             "pays under the budget in every seed |", "|---|---|---|---|"]
    for arm in order:
        if arm == SCRATCH or is_control(arm):
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
    seed, per scenario measured; and the best figure otherwise (controls are not candidates)."""
    lines = []
    for model in models:
        candidates = [a for a in order[model] if a != SCRATCH and not is_control(a)]
        if not candidates:
            continue
        for key, what in SCENARIOS:
            if key not in stats[(model, candidates[0])]["ratios"]:
                continue
            winners = [a for a in candidates if wins(stats[(model, a)]["ratios"][key], TARGET_RATIO)]
            if winners:
                lines.append(f"- **{model}, {what}: target met** by {', '.join(winners)} "
                             f"(≤ {TARGET_RATIO}x of scratch's cost in every seed).")
                continue
            if all(r is None for a in candidates for r in stats[(model, a)]["ratios"][key]):
                lines.append(f"- {model}, {what}: target **not met**; no arm reaches real-from-scratch's final loss "
                             "in any seed.")
                continue
            best = min(candidates, key=lambda a: _rank(stats[(model, a)]["ratios"][key]))
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
    med = timing["median_s"] if timing else {}
    axes_x = [("steps", lambda p, tps: 1.0), ("training FLOPs", lambda p, tps: p["flops_per_token"] * tps)]
    for label, suffix in (("wall s (real fits)", ""), ("wall s (real under budget)", BUDGET)):
        if all(p["kind"] + suffix in med for r in records for p in r["phases"]):
            axes_x.append((label, lambda p, tps, s=suffix: med[p["kind"] + s]))
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


def _reproducing(argv: List[str]) -> List[str]:
    """The study's options less where it keeps its files and how many runs share the machine:
    the command that reproduces its figures anywhere."""
    out, skip = [], False
    for a in argv:
        if skip or a in ("--work", "--out", "--jobs", "--name"):
            skip = not skip
            continue
        out.append(a)
    return out


def _header(args, timing: Optional[dict], present: List[str], seeds: List[int]) -> List[str]:
    c, shapes = args.corpus, args.shapes
    held_out = (f"documents {c.valid_docs[0]}..{c.valid_docs[1] - 1} of `{os.path.basename(c.valid_prefix)}`, "
                + ("the --valid-data-path" if c.valid_prefix != c.train_prefix else "held out from training"))
    lines = [
        "Measured by `python benchmarks/p2r_convergence.py " + " ".join(_reproducing(args.passthrough)) + "` "
        f"(seeds {' '.join(map(str, seeds))}). Corpus: **{c.name}**, tokenizer {c.tokenizer_type} "
        f"(vocabulary {args.vocab_size}); seq {args.seq}, micro-batch {args.micro_batch} "
        f"({args.seq * args.micro_batch} tokens per step), SwiGLU/RMSNorm/rotary, AdamW, LR {args.lr:g} cosine to "
        f"{args.lr / 10:g} over all {args.iters} steps (one schedule for every phase of a run). Models: "
        + "; ".join(f"**{m}** {shapes[m].layers} layers x hidden {shapes[m].hidden}" for m in present)
        + ". Every training run on one thread; the runs' records are kept under `--work`, and `--report-only` "
        "rebuilds this page and the plot from them.", "",
        "**How it is measured.** Each arm runs with every seed; a seed fixes initialisation and data order, "
        "so comparisons are paired: seed s's *target* is the final held-out loss of real-from-scratch with "
        f"seed s, and an arm's cost to reach it (linear between evaluations every {args.eval_interval} steps) is "
        f"divided by that scratch run's own. Held-out set: {args.eval_samples} samples of {args.seq} tokens from "
        f"{held_out}, the same for every run; each loss's standard error (SE) is over those samples, and a "
        "difference's SE is that of the per-sample differences (both models on the same samples). The spread over "
        "seeds (± std) is the larger uncertainty. FLOPs count each phase's own model (a grown model's early phase "
        "is cheaper per token; a pseudo model costs the same FLOPs as the real one). *FLOPs of a last-step "
        "crossing* is the ratio an arm would score if it reached the target only at its last step: what its "
        "cheaper early phase alone gives; the measured ratio below it is what the model learns after the switch. "
        f"Each growth arm has a control, *{CONTROL_PREFIX}...*: real from scratch whose LR schedule ends and "
        "decays at that arm's training FLOPs."]
    if timing:
        lines[-1] += (" **Wall time is not the runs' own** (the machine is shared): each phase kind's step time was "
                      f"measured in a separate timing run, {timing['rounds']} interleaved rounds of {timing['steps']} "
                      f"steps after {timing['warmup']} warm-up steps, median; wall time to a target is steps x that "
                      "step time, with the real model fitting and, where a budget is given ("
                      + ", ".join(f"{m} {b}" for m, b in timing["budget"].items())
                      + "), with it under `--device-memory-budget` (granular offload with recomputation, while the "
                      "pseudo model and the shallow model of growth fit). On GPUs r comes from `tools/plan.py`.")
    return lines + [""]


def _model_section(stats, controls, model: str, args, order: List[str], walls: List[str]) -> List[str]:
    shape = args.shapes[model]
    lines = [f"## {model}: {shape.layers} layers x hidden {shape.hidden}", "",
             "Ratios are the arm's cost to reach the target over scratch's, mean ± std over seeds (lower is better; "
             f"the target is ≤ {TARGET_RATIO}). SE columns: the largest over seeds.", ""]
    lines += _results_table(stats, model, order, walls) + [""]
    if any((model, a) in controls for a in order):
        lines += ["Compute-matched controls: a growth arm against real from scratch given the same training FLOPs "
                  "(its schedule decayed by then).", ""] + _control_table(controls, model, order) + [""]
    if "wall_budget" in walls:
        lines += ["Break-even under the memory budget: P2R may need Δ* = Σ early steps x (1 − 1/r) more "
                  "steps than scratch and still finish no later (`megatron_p2r/planning/breakeven.py`).", ""]
        lines += _break_even_table(stats, model, order) + [""]
    return lines


def write(records: List[dict], timing: Optional[dict], args, out: str) -> None:
    """<out>/<name>.md and <out>/<name>.png from the study's records."""
    present = [m for m in args.models if any(r["model"] == m for r in records)]
    tps = {r["model"]: r["tokens_per_step"] for r in records}
    stats = paired(records, timing["median_s"] if timing else {}, tps, SCRATCH)
    controls = matched(records, lambda arm: CONTROL_PREFIX + arm)
    order = {m: _arms_in_order(records, args.arms, m) for m in present}
    seeds = sorted({r["seed"] for r in records})
    lines = ["# Pseudo-to-Real and depth growth at small scale: does it pay?", ""] + _header(args, timing, present,
                                                                                             seeds)
    for model in present:
        walls = [w for w in ("wall", "wall_budget") if w in stats[(model, SCRATCH)]["ratios"]]
        lines += _model_section(stats, controls, model, args, order[model], walls)
    if timing:
        kinds = sorted({p["kind"] for r in records for p in r["phases"]})
        lines += ["## Step time per phase kind (timing run)", ""] + _timing_table(timing, args.shapes, kinds) + [""]
    lines += ["## Verdict", ""] + verdicts(stats, present, order) + [""]
    if args.note:
        lines += [args.note, ""]
    lines += [f"![held-out loss, mean ± std over seeds]({args.name}.png)", ""]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, args.name + ".md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    plot(records, timing, present, order, os.path.join(out, args.name + ".png"))
    print("\n".join(lines))
