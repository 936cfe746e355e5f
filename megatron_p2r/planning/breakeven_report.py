"""The planner's Pseudo-to-Real lines: r, the break-even, and with measured figures which of
Pseudo-to-Real and depth growth pays on the planned cluster (``breakeven.measured_verdict``)."""
from __future__ import annotations

from typing import List

METHODS = {"p2r": "Pseudo-to-Real", "growth": "depth growth"}


def format_p2r(summary: dict) -> str:
    """r and the break-even; the measured verdict below them when figures were given."""
    r, extra = summary["r"], summary["break_even_extra_steps"]
    lines = [f"== Pseudo-to-Real: step time real {summary['real_step_s']:.3g} s / pseudo "
             f"{summary['pseudo_step_s']:.3g} s: r = {r:.3f}",
             f"   delinking after {summary['switch_iters']:,} of {summary['total_iters']:,} steps "
             f"(--p2r-switch-iters): break-even s(1 - 1/r) = {extra:,.0f} steps "
             f"({summary['break_even_fraction']:.2%} of the run)"]
    if extra > 0:
        lines.append("   P2R finishes no later than real-from-scratch if, after delinking, it reaches the same loss "
                     f"with at most {extra:,.0f} more steps in total")
    else:
        lines.append("   r <= 1: the pseudo phase is not cheaper per step here, so P2R pays in time only if it "
                     "reaches the loss in fewer steps than real-from-scratch (docs/results.md: at small scale it "
                     "needed more)")
    return "\n".join(lines + measured_lines(summary))


def measured_lines(summary: dict) -> List[str]:
    """What the measured gap and growth's FLOPs ratio say about this cluster."""
    measured = summary.get("measured")
    if measured is None:
        return []
    lines = []
    p2r = measured.get("p2r")
    if p2r is not None and p2r["time_ratio"] is None:
        lines.append("   measured gap: never (P2R did not reach real-from-scratch's loss): P2R does not pay in time here")
    elif p2r is not None:
        lines.append(f"   measured gap: {p2r['extra_steps']:,.0f} extra steps (break-even "
                     f"{summary['break_even_extra_steps']:,.0f}): P2R takes {p2r['time_ratio']:.3f}x real-from-scratch's time to its loss, so it "
                     f"{'pays' if p2r['pays'] else 'does not pay'} on this cluster")
    growth = measured.get("growth")
    if growth is not None:
        lines.append(f"   depth growth: {growth['time_ratio']:.3f}x real-from-scratch's FLOPs to its loss (wall time "
                     f"taken as proportional): it {'pays' if growth['pays'] else 'does not pay'}")
    best = measured["best"]
    if best is None:
        lines.append("   verdict: neither pays on this cluster")
    else:
        both = all(m in measured and measured[m]["pays"] for m in METHODS)
        lines.append(f"   verdict: {METHODS[best]} pays{' (the lower time ratio of the two)' if both else ''}")
    return lines
