"""Learning rate: linear warm-up, then cosine / linear / constant decay to ``min_lr``; and an
optional re-warm-up after a Pseudo-to-Real delink or a depth growth.

The re-warm-up is a separate piece of the scheduler's state, ``{"start": s, "iters": n}``: the
scheduled LR is multiplied by ``(step - s + 1) / n`` for the n steps from s, so a model whose
layers were just copied does not take full-size steps while its optimizer state is re-forming.
The converter records it in the checkpoint (``with_rewarmup``); a resume restores it with the
step count, so a run saved in the middle of a re-warm-up continues exactly.
"""
from __future__ import annotations

import math
from typing import Optional

from megatron_p2r.config import TrainConfig


def learning_rate(step: int, t: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based), a pure function of the config."""
    if t.lr_warmup_iters and step < t.lr_warmup_iters:
        return t.lr * (step + 1) / t.lr_warmup_iters
    if t.lr_decay_style == "constant":
        return t.lr
    decay_iters = (t.lr_decay_iters or t.train_iters) - t.lr_warmup_iters
    progress = min(max(step - t.lr_warmup_iters, 0) / max(decay_iters, 1), 1.0)
    if t.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr + coeff * (t.lr - t.min_lr)


def rewarmup_factor(step: int, rewarmup: Optional[dict]) -> float:
    """The re-warm-up's multiplier of the scheduled LR at ``step`` (1 outside it)."""
    if not rewarmup:
        return 1.0
    start, iters = rewarmup["start"], rewarmup["iters"]
    return (step - start + 1) / iters if start <= step < start + iters else 1.0


def check_rewarmup(rewarmup: Optional[dict]) -> Optional[dict]:
    """``rewarmup`` when it is None or ``{"start": int >= 0, "iters": int >= 1}``, else ValueError."""
    if rewarmup is None:
        return None
    ok = isinstance(rewarmup, dict) and set(rewarmup) == {"start", "iters"} and all(
        isinstance(rewarmup[k], int) and not isinstance(rewarmup[k], bool) for k in rewarmup)
    if not ok or rewarmup["start"] < 0 or rewarmup["iters"] < 1:
        raise ValueError(f"rewarmup must be null or {{'start': int >= 0, 'iters': int >= 1}}, got {rewarmup!r}")
    return dict(rewarmup)


def with_rewarmup(state: dict, iters: int) -> dict:
    """A saved scheduler state with a re-warm-up of ``iters`` steps starting at its next step
    (what ``convert_checkpoint.py delink/grow --lr-rewarmup-iters`` records)."""
    if iters < 1:
        raise ValueError(f"--lr-rewarmup-iters must be >= 1, got {iters}")
    return {**state, "rewarmup": {"start": int(state["step_count"]), "iters": int(iters)}}


class LRScheduler:
    """Sets the optimizer's LR each step; its state is the step count and the re-warm-up."""

    def __init__(self, optimizer, t: TrainConfig, step: int = 0):
        self.optimizer, self.t, self.step_count = optimizer, t, step
        self.rewarmup: Optional[dict] = None
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    @property
    def lr(self) -> float:
        return learning_rate(self.step_count, self.t) * rewarmup_factor(self.step_count, self.rewarmup)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "rewarmup": self.rewarmup}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.rewarmup = check_rewarmup(state.get("rewarmup"))
        self._apply()
