"""Learning rate: linear warm-up, then cosine / linear / constant decay to ``min_lr``."""
from __future__ import annotations

import math

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


class LRScheduler:
    """Sets the optimizer's LR each step; its only state is the step count."""

    def __init__(self, optimizer, t: TrainConfig, step: int = 0):
        self.optimizer, self.t, self.step_count = optimizer, t, step
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step_count, self.t)

    @property
    def lr(self) -> float:
        return learning_rate(self.step_count, self.t)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
