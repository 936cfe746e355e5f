"""When does Pseudo-to-Real (or depth growth) pay in wall time? The break-even of a run whose
early phases are cheaper per step than the real model.

A P2R run trains s steps in a phase whose step costs 1/r of the real model's (the pseudo model
fits without the offload or recomputation the real model needs, moves less gradient and
optimizer state; a grown model's early phase computes fewer layers), then continues as the
real model. If real-from-scratch reaches a loss in N steps, the P2R run that reaches it in
N + D steps takes ``s / r + (N + D - s)`` real-step times, so it is no slower exactly when

    D <= s * (1 - 1/r)                (one early phase; sum over phases for several)

D is what the convergence study measures (``p2r-study``, ``tools/p2r_study``); r is what the
planner estimates for a cluster (``tools/plan.py``) or a timing run measures. Given both, the
planner says whether P2R or growth (from its measured FLOPs ratio) pays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, List, Optional, Tuple


def cost_ratio(real_step_s: float, early_step_s: float) -> float:
    """r: the real model's step time over the early phase's."""
    if real_step_s <= 0 or early_step_s <= 0:
        raise ValueError(f"step times must be > 0, got real {real_step_s} and early {early_step_s}")
    return real_step_s / early_step_s


def break_even_extra_steps(early_phases: Iterable[Tuple[float, float]]) -> float:
    """The most extra steps (beyond real-from-scratch's) a run may need to reach a loss and still
    take no longer, for early phases of (steps, r) each: sum of steps * (1 - 1/r). Negative
    when the early phases are slower than the real model (r < 1): then it must need fewer."""
    return sum(steps * (1.0 - 1.0 / r) for steps, r in early_phases)


def p2r_break_even(real_step_s: float, pseudo_step_s: float, switch_iters: int, total_iters: int) -> dict:
    """The planner's summary for one pseudo/real pair: r, and the extra steps a run that
    delinks after ``switch_iters`` of ``total_iters`` may need to break even."""
    r = cost_ratio(real_step_s, pseudo_step_s)
    extra = break_even_extra_steps([(switch_iters, r)])
    return {
        "r": r,
        "real_step_s": real_step_s,
        "pseudo_step_s": pseudo_step_s,
        "switch_iters": switch_iters,
        "total_iters": total_iters,
        "break_even_extra_steps": extra,
        "break_even_fraction": extra / total_iters if total_iters else None,
    }


@dataclasses.dataclass(frozen=True)
class Gap:
    """A measured gap: ``value`` extra steps (a fraction of the run's steps with ``fraction``),
    None when the run never reached the target."""

    value: Optional[float]
    fraction: bool = False

    def steps(self, total_iters: float) -> Optional[float]:
        if self.value is None:
            return None
        return self.value * total_iters if self.fraction else self.value


def parse_gap(text: str) -> Gap:
    """``never``; ``120`` extra steps; ``5%`` of the run's steps (how a gap measured on a short run
    carries over to a longer one). Negative: the run needed fewer steps than scratch."""
    value = text.strip().lower()
    if value == "never":
        return Gap(None)
    fraction = value.endswith("%")
    try:
        number = float(value[:-1] if fraction else value)
    except ValueError:
        raise ValueError(f"expected extra steps (120), a percentage of the run (5%) or 'never', got {text!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"the gap must be finite, got {text!r}")
    return Gap(number / 100, True) if fraction else Gap(number)


def p2r_time_ratio(r: float, switch_iters: float, total_iters: float, extra_steps: Optional[float]) -> Optional[float]:
    """Pseudo-to-Real's wall time to scratch's loss over scratch's, (s/r + N + D - s) / N, for a
    run that needs D extra steps; None when it never reaches the loss."""
    if extra_steps is None:
        return None
    return (switch_iters / r + total_iters + extra_steps - switch_iters) / total_iters


def measured_verdict(summary: dict, gap: Optional[Gap] = None, growth_flops_ratio: Optional[float] = None) -> dict:
    """Which of Pseudo-to-Real (its measured ``gap``) and depth growth (its measured training FLOPs
    to the target over scratch's; its wall time taken as proportional to them) pays for the
    planned cluster (``summary``: ``p2r_break_even``'s). Each ratio is the method's time to
    scratch's loss over scratch's: below 1 it pays (at 1 it only ties); ``best`` is the paying
    method with the lower ratio."""
    out: dict = {}
    if gap is not None:
        extra = gap.steps(summary["total_iters"])
        ratio = p2r_time_ratio(summary["r"], summary["switch_iters"], summary["total_iters"], extra)
        out["p2r"] = {"extra_steps": extra, "time_ratio": ratio, "pays": ratio is not None and ratio < 1}
    if growth_flops_ratio is not None:
        out["growth"] = {"time_ratio": growth_flops_ratio, "pays": growth_flops_ratio < 1}
    paying = {k: v["time_ratio"] for k, v in out.items() if v["pays"]}
    out["best"] = min(paying, key=paying.get) if paying else None
    return out


METHODS = {"p2r": "Pseudo-to-Real", "growth": "depth growth"}


def format_p2r(summary: dict) -> str:
    """r and the break-even; the measured verdict below them when figures were given."""
    r, extra = summary["r"], summary["break_even_extra_steps"]
    lines = [
        f"== Pseudo-to-Real: step time real {summary['real_step_s']:.3g} s / pseudo "
        f"{summary['pseudo_step_s']:.3g} s: r = {r:.3f}",
        f"   delinking after {summary['switch_iters']:,} of {summary['total_iters']:,} steps "
        f"(--p2r-switch-iters): break-even s(1 - 1/r) = {extra:,.0f} steps "
        f"({summary['break_even_fraction']:.2%} of the run)",
    ]
    if extra > 0:
        lines.append(
            "   P2R finishes no later than real-from-scratch if, after delinking, it reaches the same loss "
            f"with at most {extra:,.0f} more steps in total"
        )
    else:
        lines.append(
            "   r <= 1: the pseudo phase is not cheaper per step here, so P2R pays in time only if it "
            "reaches the loss in fewer steps than real-from-scratch (docs/results.md: at small scale it "
            "needed more)"
        )
    return "\n".join(lines + measured_lines(summary))


def measured_lines(summary: dict) -> List[str]:
    """What the measured gap and growth's FLOPs ratio say about this cluster."""
    measured = summary.get("measured")
    if measured is None:
        return []
    lines = []
    p2r = measured.get("p2r")
    if p2r is not None and p2r["time_ratio"] is None:
        lines.append(
            "   measured gap: never (P2R did not reach real-from-scratch's loss): P2R does not pay in time here"
        )
    elif p2r is not None:
        lines.append(
            f"   measured gap: {p2r['extra_steps']:,.0f} extra steps (break-even "
            f"{summary['break_even_extra_steps']:,.0f}): P2R takes {p2r['time_ratio']:.3f}x real-from-scratch's time to its loss, so it "
            f"{'pays' if p2r['pays'] else 'does not pay'} on this cluster"
        )
    growth = measured.get("growth")
    if growth is not None:
        lines.append(
            f"   depth growth: {growth['time_ratio']:.3f}x real-from-scratch's FLOPs to its loss (wall time "
            f"taken as proportional): it {'pays' if growth['pays'] else 'does not pay'}"
        )
    best = measured["best"]
    if best is None:
        lines.append("   verdict: neither pays on this cluster")
    else:
        both = all(m in measured and measured[m]["pays"] for m in METHODS)
        lines.append(f"   verdict: {METHODS[best]} pays{' (the lower time ratio of the two)' if both else ''}")
    return lines
