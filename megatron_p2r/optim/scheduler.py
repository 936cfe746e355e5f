"""Learning rate: Megatron-LM's ``OptimizerParamScheduler``, counted in samples.

Linear warm-up from 0, then cosine / linear / constant decay to ``min_lr``. The position is the
number of samples of the *applied* updates (a step skipped for non-finite gradients does not
advance it, as in Megatron-LM); the warm-up and decay lengths come from the iteration or the
sample flags (``config.batch.lr_lengths``). A parameter group may carry its own ``max_lr`` /
``min_lr`` (``--decoupled-lr`` for the embedding and output layer).
"""
from __future__ import annotations

import math

from megatron_p2r.config import Config
from megatron_p2r.config.batch import lr_lengths


def learning_rate(num_steps: float, warmup: float, decay: float, style: str, max_lr: float, min_lr: float) -> float:
    """The LR after ``num_steps`` samples (Megatron's ``get_lr`` with ``--lr-warmup-init 0``)."""
    if warmup > 0 and num_steps <= warmup:
        return max_lr * num_steps / warmup
    if style == "constant":
        return max_lr
    if num_steps >= decay:  # Megatron: min_lr past the decay; its formula also gives it at the end
        return min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


class LRScheduler:
    """Sets every parameter group's LR; its only state is the sample count ``num_steps``."""

    def __init__(self, optimizer, cfg: Config, world_size: int, num_steps: int = 0):
        self.optimizer, self.t, self.num_steps = optimizer, cfg.train, num_steps
        self.warmup, self.decay = lr_lengths(cfg, world_size)
        self._apply()

    def _at(self, max_lr: float, min_lr: float) -> float:
        return learning_rate(self.num_steps, self.warmup, self.decay, self.t.lr_decay_style, max_lr, min_lr)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._at(group.get("max_lr", self.t.lr), group.get("min_lr", self.t.min_lr))

    @property
    def lr(self) -> float:
        """The LR of the groups without their own (the one the log shows)."""
        return self._at(self.t.lr, self.t.min_lr)

    def step(self, samples: int) -> None:
        """After an applied update of ``samples`` samples."""
        self.num_steps += samples
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
