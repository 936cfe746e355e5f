"""The study's report: a markdown page (tables of mean ± std over seeds, paired differences with
three standard errors, ratios, timing, break-even, one verdict line per claim) and the plot of
paired differences, written from the saved records and timing by ``p2r-study`` (also with
``--report-only``)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from tools.p2r_study.analysis import BUDGET, fmt, matched, paired, ratio_cell, seed_se, wins
from tools.p2r_study.arms import CONTROL_PREFIX, SCRATCH, is_control
from tools.p2r_study.plot import CAPTION, plot

MARKER = "<!-- written by p2r-study from the --work with key {key} -->"
SE_RULE = (
    "**Which SE the verdict uses.** A seed counts for a claim when its difference exceeds 2 of its "
    "document-clustered SEs (held-out samples cut from one document are not independent, so it is usually "
    "the larger of a seed's two SEs); each claim's figure is the mean over seeds ± the seed-to-seed SE, "
    "which is what another set of seeds could change."
)

TARGET_RATIO = 0.8
SCENARIOS = (
    ("flops", "training FLOPs"),
    ("wall", "wall time, real model fits"),
    ("wall_budget", "wall time, real model under the memory budget"),
)


def _arms_in_order(records: List[dict], arms: dict, model: str) -> List[str]:
    present = {r["arm"] for r in records if r["model"] == model}
    return [a for a in arms[model] if a in present]


def _worst(values) -> str:
    known = [v for v in values if v is not None]
    return f"{max(known):.3f}" if known else "-"


def _seed_se(values) -> str:
    se = seed_se(values)
    return "-" if se is None else f"{se:.3f}"


def _se_cells(e: dict) -> List[str]:
    """A difference's three SEs: held-out samples and documents (largest over seeds), seeds."""
    return [_worst(e["delta_se"]), _worst(e["delta_dse"]), _seed_se(e["delta"])]


SE_HEADS = ["SE of Δ: held-out samples", "SE of Δ: documents", "SE of Δ: seeds"]


def _results_table(stats: Dict[tuple, dict], model: str, order: List[str], walls: List[str]) -> List[str]:
    wall_heads = {"wall": "wall to target (fits)", "wall_budget": "wall to target (budget)"}
    heads = [
        "arm",
        "seeds",
        "final held-out loss",
        "its SE",
        "Δ vs scratch (paired)",
        *SE_HEADS,
        "steps to target",
        "FLOPs to target",
        "FLOPs of a last-step crossing",
        *(wall_heads[w] for w in walls),
    ]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for arm in order:
        e = stats[(model, arm)]
        r = e["ratios"]
        delta = ["-"] * 4 if arm == SCRATCH else [fmt(e["delta"]), *_se_cells(e)]
        if is_control(arm):  # it stops at the growth arm's FLOPs by design: its cost to the target says nothing
            costs = ["(a control)"] * (3 + len(walls))
        else:
            costs = [
                ratio_cell(r["steps"]),
                ratio_cell(r["flops"]),
                fmt(e["last_step_flops"], 2),
                *(ratio_cell(r[w]) for w in walls),
            ]
        lines.append(
            "| " + " | ".join([arm, str(len(e["seeds"])), fmt(e["final"]), _worst(e["se"]), *delta, *costs]) + " |"
        )
    return lines


def _beyond(e: dict, sign: int = -1) -> int:
    """Seeds whose difference lies more than 2 document-clustered SEs (the held-out SE without
    documents) below 0 (``sign`` -1) or above it (+1)."""
    return sum(
        sign * d > 2 * (dse if dse is not None else se)
        for d, se, dse in zip(e["delta"], e["delta_se"], e["delta_dse"], strict=True)
    )


def _control_table(controls: Dict[tuple, dict], model: str, order: List[str]) -> List[str]:
    lines = [
        "| growth arm | its final loss − its control's (paired, mean ± std over seeds) | "
        + " | ".join(SE_HEADS)
        + " | seeds lower than its control by more than 2 document SEs |",
        "|---|---|---|---|---|---|",
    ]
    for arm in order:
        e = controls.get((model, arm))
        if e is None:
            continue
        lines.append(f"| {arm} | {fmt(e['delta'])} | {' | '.join(_se_cells(e))} | {_beyond(e)} of {len(e['delta'])} |")
    return lines


def _timing_table(timing: dict, shapes: dict, kinds: List[str]) -> List[str]:
    med = timing["median_s"]
    lines = [
        "| phase kind (model/layers/share pattern) | ms per step | ms per step under the budget "
        "(layers offloaded) | real ÷ this | real ÷ this, under the budget |",
        "|---|---|---|---|---|",
    ]
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
    lines = [
        "| arm | extra steps it may need and still break even (Δ*) | extra steps it needed (D) | "
        "pays under the budget in every seed |",
        "|---|---|---|---|",
    ]
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


def _claim(e: dict, what: str) -> str:
    """One claim: the mean difference ± its seed SE, and in how many seeds it holds."""
    n, lower = len(e["delta"]), sum(d < 0 for d in e["delta"])
    mean = sum(e["delta"]) / n
    se = seed_se(e["delta"])
    figure = f"{mean:+.3f}" + (
        "" if se is None else " (equal in every seed)" if f"{se:.3f}" == "0.000" else f" ± {se:.3f} (seed SE)"
    )
    sign = -1 if mean < 0 else 1
    side = f"lower in {lower} of {n} seeds" if sign < 0 else f"higher in {n - lower} of {n} seeds"
    return f"{what}: final held-out loss {figure}; {side}, by more than 2 document SEs in {_beyond(e, sign)} of {n}."


def verdicts(
    stats: Dict[tuple, dict], controls: Dict[tuple, dict], models: List[str], order: Dict[str, List[str]]
) -> List[str]:
    """One line per claim: per scenario, which arm reaches scratch's final loss with <= 0.8x its
    cost in every seed (or the best figure; controls are not candidates); then each arm's final
    gap to scratch, and each growth arm's to its compute-matched control, with seed counts."""
    lines = []
    for model in models:
        candidates = [a for a in order[model] if a != SCRATCH and not is_control(a)]
        for key, what in SCENARIOS if candidates else ():
            if key not in stats[(model, candidates[0])]["ratios"]:
                continue
            winners = [a for a in candidates if wins(stats[(model, a)]["ratios"][key], TARGET_RATIO)]
            if winners:
                lines.append(
                    f"- **{model}, {what}: target met** by {', '.join(winners)} "
                    f"(≤ {TARGET_RATIO}x of scratch's cost in every seed)."
                )
                continue
            if all(r is None for a in candidates for r in stats[(model, a)]["ratios"][key]):
                lines.append(
                    f"- {model}, {what}: target **not met**; no arm reaches real-from-scratch's final loss in any seed."
                )
                continue
            best = min(candidates, key=lambda a: _rank(stats[(model, a)]["ratios"][key]))
            lines.append(
                f"- {model}, {what}: target **not met**; the best arm, {best}, "
                f"{_describe(stats[(model, best)]['ratios'][key])}."
            )
        for arm in candidates:
            lines.append("- " + _claim(stats[(model, arm)], f"{model}, **{arm}** against real from scratch"))
            if (model, arm) in controls:
                lines.append(
                    "- " + _claim(controls[(model, arm)], f"{model}, **{arm}** against its compute-matched control")
                )
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


PATH_OPTIONS = ("--data-path", "--valid-data-path", "--tokenizer-model")
LOCAL_OPTIONS = ("--work", "--out", "--jobs", "--name")


def _reproducing(argv: List[str]) -> List[str]:
    """The study's options less where it keeps its files and how many runs share the machine, and
    with file names in place of paths: the command that reproduces its figures anywhere (the
    report never carries a path of the machine it ran on)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if skip or a in LOCAL_OPTIONS:
            skip = not skip
            continue
        if eq and name in LOCAL_OPTIONS:
            continue
        if eq and name in PATH_OPTIONS:
            a = f"{name}={os.path.basename(value)}"
        elif i and argv[i - 1] in PATH_OPTIONS:
            a = os.path.basename(a)
        out.append(a)
    return out


def _held_out_words(c) -> str:
    docs = f"{c.valid_docs[1] - c.valid_docs[0]} documents"
    return {
        "given": f"the {docs} of the --valid-data-path, `{os.path.basename(c.valid_prefix)}`",
        "documents": f"{docs} drawn at random (seeded) from the corpus and never trained on",
        "tail": f"documents {c.valid_docs[0]}..{c.valid_docs[1] - 1}, the corpus's last {docs}, never trained on",
    }[c.held_out]


def _header(args, timing: Optional[dict], present: List[str], seeds: List[int]) -> List[str]:
    c, shapes = args.corpus, args.shapes
    lines = [
        "Measured by `p2r-study " + " ".join(_reproducing(args.passthrough)) + "` "
        f"(seeds {' '.join(map(str, seeds))}). Corpus: **{c.name}**, tokenizer {c.tokenizer_type} "
        f"(vocabulary {args.vocab_size}); seq {args.seq}, micro-batch {args.micro_batch} "
        f"({args.seq * args.micro_batch} tokens per step), SwiGLU/RMSNorm/rotary, AdamW, LR {args.lr:g} cosine to "
        f"{args.lr / 10:g} over all {args.iters} steps (one schedule for every phase of a run). Models: "
        + "; ".join(f"**{m}** {shapes[m].layers} layers x hidden {shapes[m].hidden}" for m in present)
        + ". Every training run on one thread; the runs' records are kept under `--work`, and `--report-only` "
        "rebuilds this page and the plot from them.",
        "",
        "**How it is measured.** Each arm runs with every seed; a seed fixes initialisation and data order, "
        "so comparisons are paired: seed s's *target* is the final held-out loss of real-from-scratch with "
        f"seed s, and an arm's cost to reach it (linear between evaluations every {args.eval_interval} steps) is "
        f"divided by that scratch run's own. Held-out set: {args.eval_samples} samples of {args.seq} tokens from "
        f"{_held_out_words(c)}, the same for every run. Each loss's standard error (SE) is over those samples. "
        "A difference Δ has three: *held-out samples*, the SE of the per-sample differences (both models on the "
        "same samples; it holds the trained models fixed); *documents*, the same with the samples grouped by the "
        "document they start in (samples of one document are not independent); *seeds*, the SE of the mean Δ over "
        "seeds (other initialisations and data orders), usually the largest. FLOPs count each phase's own model "
        "(a grown model's early phase is cheaper per token; a pseudo model costs the same FLOPs as the real one). "
        "*FLOPs of a last-step crossing* is the ratio an arm would score if it reached the target only at its last "
        "step: what its cheaper early phase alone gives; the measured ratio below it is what the model learns "
        f"after the switch. Each growth arm has a control, *{CONTROL_PREFIX}...*: real from scratch whose LR "
        "schedule ends and decays at that arm's training FLOPs; it stops short of scratch's budget by design, so "
        "its cost to the target is not a finding.",
    ]
    if timing:
        lines[-1] += (
            " **Wall time is not the runs' own** (the machine is shared): each phase kind's step time was "
            f"measured in a separate timing run, {timing['rounds']} interleaved rounds of {timing['steps']} "
            f"steps after {timing['warmup']} warm-up steps, median; wall time to a target is steps x that "
            "step time, with the real model fitting and, where a budget is given ("
            + ", ".join(f"{m} {b}" for m, b in timing["budget"].items())
            + "), with it under `--device-memory-budget` (granular offload with recomputation, while the "
            "pseudo model and the shallow model of growth fit). On GPUs r comes from `tools/plan.py`."
        )
    return lines + [""]


def _model_section(stats, controls, model: str, args, order: List[str], walls: List[str]) -> List[str]:
    shape = args.shapes[model]
    lines = [
        f"## {model}: {shape.layers} layers x hidden {shape.hidden}",
        "",
        "Ratios are the arm's cost to reach the target over scratch's, mean ± std over seeds (lower is better; "
        f"the target is ≤ {TARGET_RATIO}). SE columns: the largest over seeds.",
        "",
    ]
    lines += _results_table(stats, model, order, walls) + [""]
    if any((model, a) in controls for a in order):
        lines += (
            [
                "Compute-matched controls: a growth arm against real from scratch given the same training FLOPs "
                "(its schedule decayed by then).",
                "",
            ]
            + _control_table(controls, model, order)
            + [""]
        )
    if "wall_budget" in walls:
        lines += [
            "Break-even under the memory budget: P2R may need Δ* = Σ early steps x (1 − 1/r) more "
            "steps than scratch and still finish no later (`megatron_p2r/planning/breakeven.py`).",
            "",
        ]
        lines += _break_even_table(stats, model, order) + [""]
    return lines


def write(records: List[dict], timing: Optional[dict], args, out: str, documents=None, key: str = "") -> None:
    """<out>/<name>.md and <out>/<name>.png from the study's records; ``documents``: the document
    each held-out sample starts in (for the clustered SE)."""
    present = [m for m in args.models if any(r["model"] == m for r in records)]
    tps = {r["model"]: r["tokens_per_step"] for r in records}
    stats = paired(records, timing["median_s"] if timing else {}, tps, SCRATCH, documents)
    controls = matched(records, lambda arm: CONTROL_PREFIX + arm, documents)
    order = {m: _arms_in_order(records, args.arms, m) for m in present}
    seeds = sorted({r["seed"] for r in records})
    lines = ["# Pseudo-to-Real and depth growth at small scale: does it pay?", ""] + _header(
        args, timing, present, seeds
    )
    for model in present:
        walls = [w for w in ("wall", "wall_budget") if w in stats[(model, SCRATCH)]["ratios"]]
        lines += _model_section(stats, controls, model, args, order[model], walls)
    if timing:
        kinds = sorted({p["kind"] for r in records for p in r["phases"]})
        lines += ["## Step time per phase kind (timing run)", ""] + _timing_table(timing, args.shapes, kinds) + [""]
    lines += ["## Verdict", "", SE_RULE, ""] + verdicts(stats, controls, present, order) + [""]
    if args.note:
        lines += [args.note, ""]
    lines += [
        f"![held-out loss minus real from scratch's, per family of arms]({args.name}.png)",
        "",
        CAPTION,
        "",
        MARKER.format(key=key),
        "",
    ]
    os.makedirs(out, exist_ok=True)
    plot(records, present, order, os.path.join(out, args.name + ".png"))
    path = os.path.join(out, args.name + ".md")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    os.replace(path + ".tmp", path)
    print("\n".join(lines))
