"""When does Pseudo-to-Real (or depth growth) pay in wall time? The break-even of a run whose
early phases are cheaper per step than the real model.

A P2R run trains s steps in a phase whose step costs 1/r of the real model's (the pseudo model
fits without the offload or recomputation the real model needs, moves less gradient and
optimizer state; a grown model's early phase computes fewer layers), then continues as the
real model. If real-from-scratch reaches a loss in N steps, the P2R run that reaches it in
N + D steps takes ``s / r + (N + D - s)`` real-step times, so it is no slower exactly when

    D <= s * (1 - 1/r)                (one early phase; sum over phases for several)

D is what the convergence study measures (``benchmarks/p2r_convergence.py``); r is what the
planner estimates for a cluster (``tools/plan.py``) or a timing run measures.
"""
from __future__ import annotations

from typing import Iterable, Tuple


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
    return {"r": r, "real_step_s": real_step_s, "pseudo_step_s": pseudo_step_s, "switch_iters": switch_iters,
            "total_iters": total_iters, "break_even_extra_steps": extra,
            "break_even_fraction": extra / total_iters if total_iters else None}
