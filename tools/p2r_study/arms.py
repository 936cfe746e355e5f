"""The convergence study's model shapes and arms, built from its options.

An arm is a list of phases trained one after another under one LR schedule; a phase ends at a
fraction of ``--iters`` and names the conversion into the next one. Today's study is the
default: ``deep`` 24 x 64 with every Pseudo-to-Real recipe and growth x4, ``wide`` 8 x 128 with
the noisy delink and growth x2, each switch at 10% (P2R) and 25% (growth). Every growth arm
gets a compute-matched control: real from scratch whose schedule ends and decays at the
growth arm's training FLOPs, so a growth win is not just a shorter schedule decayed sooner.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

SCRATCH = "real from scratch"
CONTROL_PREFIX = "scratch decayed at the FLOPs of "
ARM_KINDS = ("p2r", "p2r-noise", "progressive", "grow", "matched")
DEFAULT_SHAPES = ("deep=24x64@12MiB", "wide=8x128@26MiB")
DEFAULT_ARMS = {"deep": ARM_KINDS, "wide": ("p2r-noise", "grow", "matched")}
DEFAULT_GROW_FACTORS = {"deep": (4,), "wide": (2,)}
HEADS = 4


class ArmError(ValueError):
    """A model shape, arm kind or switch point the study cannot run."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model of ``layers`` x ``hidden``; ``budget`` is the device memory it must run under in
    the offload scenario of the timing run (None: no such scenario for it)."""

    layers: int
    hidden: int
    budget: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Phase:
    """One training phase of an arm and the conversion into the next one."""

    until: float  # fraction of --iters at which it ends
    shallower: int = 1  # the model's layers / this phase's layers (growth)
    pattern: str = "none"  # share pattern; none: the real model
    convert: Tuple[str, ...] = ()  # converter command and options into the next phase


SYMMETRY = ("--noise-std", "0.01", "--noise-relative", "--lr-rewarmup-iters", "{rewarmup}")


def parse_shape(text: str) -> Tuple[str, Shape]:
    """``deep=24x64@12MiB`` -> ("deep", Shape(24, 64, "12MiB")); the budget is optional."""
    m = re.fullmatch(r"([A-Za-z][\w-]*)=(\d+)x(\d+)(?:@(\S+))?", text)
    if not m:
        raise ArmError(f"--model {text!r}: expected NAME=LAYERSxHIDDEN[@BUDGET], e.g. deep=24x64@12MiB")
    layers, hidden = int(m.group(2)), int(m.group(3))
    if layers < 1 or hidden < HEADS or hidden % HEADS:
        raise ArmError(
            f"--model {text!r}: needs at least one layer and a hidden size that is a multiple of "
            f"the {HEADS} attention heads"
        )
    return m.group(1), Shape(layers, hidden, m.group(4))


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def p2r_arms(kinds: Sequence[str], at: float) -> Dict[str, List[Phase]]:
    out = {}
    if "p2r" in kinds:
        out[f"P2R at {_pct(at)}"] = [Phase(at, pattern="all", convert=("delink",)), Phase(1.0)]
    if "p2r-noise" in kinds:
        out[f"P2R at {_pct(at)}, noise + re-warm-up"] = [
            Phase(at, pattern="all", convert=("delink", *SYMMETRY)),
            Phase(1.0),
        ]
    if "progressive" in kinds:
        first, second = at / 2, at * 1.5
        name = "progressive all→cycle:4→none" + ("" if at == 0.1 else f" at {_pct(first)}/{_pct(second)}")
        out[name] = [
            Phase(first, pattern="all", convert=("delink", "--target-share-pattern", "cycle:4")),
            Phase(second, pattern="cycle:4", convert=("delink", *SYMMETRY)),
            Phase(1.0),
        ]
    return out


def grow_arm(factor: int, at: float) -> Tuple[str, List[Phase]]:
    return (
        f"grow ×{factor} (stack) at {_pct(at)}",
        [Phase(at, shallower=factor, convert=("grow", "--lr-rewarmup-iters", "{rewarmup}")), Phase(1.0)],
    )


def flops_fraction(plan: Sequence[Phase], flops_per_token: Callable[[int], float], layers: int) -> float:
    """The arm's training FLOPs over real-from-scratch's, both over the whole run."""
    total, start = 0.0, 0.0
    for phase in plan:
        total += (phase.until - start) * flops_per_token(layers // phase.shallower)
        start = phase.until
    return total / flops_per_token(layers)


def build_arms(
    shape: Shape,
    kinds: Sequence[str],
    p2r_at: Sequence[float],
    grow_at: Sequence[float],
    grow_factors: Sequence[int],
    flops_per_token: Callable[[int], float],
) -> Dict[str, List[Phase]]:
    """Arm name -> phases for one model, real from scratch first (the reference of every other arm);
    growth factors that do not divide its layers are refused."""
    unknown = sorted(set(kinds) - set(ARM_KINDS))
    if unknown:
        raise ArmError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARM_KINDS)}")
    for fraction in (*p2r_at, *grow_at):
        if not 0 < fraction < 1:
            raise ArmError(f"a switch point is a fraction of the run between 0 and 1, got {fraction}")
    arms: Dict[str, List[Phase]] = {SCRATCH: [Phase(1.0)]}  # every arm is paired against it
    for at in p2r_at:
        arms.update(p2r_arms(kinds, at))
    grown = {}
    if "grow" in kinds or "matched" in kinds:
        for factor in grow_factors:
            if factor < 2 or shape.layers % factor:
                raise ArmError(
                    f"--grow-factors {factor}: must be at least 2 and divide the model's {shape.layers} layers"
                )
            grown.update(grow_arm(factor, at) for at in grow_at)
    if "grow" in kinds:
        arms.update(grown)
    if "matched" in kinds:
        for name, plan in grown.items():
            arms[CONTROL_PREFIX + name] = [Phase(round(flops_fraction(plan, flops_per_token, shape.layers), 4))]
    return arms


def is_control(arm: str) -> bool:
    return arm.startswith(CONTROL_PREFIX)
