"""Learning rate: Megatron-LM's ``OptimizerParamScheduler``, counted in samples; and an optional
re-warm-up after a Pseudo-to-Real delink or a depth growth.

Linear warm-up from 0, then cosine / linear / constant decay to ``min_lr``. The position is the
number of samples of the *applied* updates (a step skipped for non-finite gradients does not
advance it, as in Megatron-LM); the warm-up and decay lengths come from the iteration or the
sample flags (``config.batch.lr_lengths``). A parameter group may carry its own ``max_lr`` /
``min_lr`` (``--decoupled-lr`` for the embedding and output layer).

The re-warm-up is a separate part of the scheduler's state, ``{"start": u, "iters": n}`` in
applied updates: the scheduled LR is multiplied by ``(u' - u + 1) / n`` for the n updates from u,
so a model whose layers were just copied does not take full-size steps while its optimizer state
is re-forming. The converter records it in the checkpoint (``with_rewarmup``); a resume restores
it with the counts, so a run saved in the middle of a re-warm-up continues exactly.
"""

from __future__ import annotations

import math
from typing import Optional

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


def rewarmup_factor(update: int, rewarmup: Optional[dict]) -> float:
    """The re-warm-up's multiplier of the scheduled LR at applied update ``update`` (1 outside it)."""
    if not rewarmup:
        return 1.0
    start, iters = rewarmup["start"], rewarmup["iters"]
    return (update - start + 1) / iters if start <= update < start + iters else 1.0


def check_rewarmup(rewarmup: Optional[dict]) -> Optional[dict]:
    """``rewarmup`` when it is None or ``{"start": int >= 0, "iters": int >= 1}``, else ValueError."""
    if rewarmup is None:
        return None
    ok = (
        isinstance(rewarmup, dict)
        and set(rewarmup) == {"start", "iters"}
        and all(isinstance(rewarmup[k], int) and not isinstance(rewarmup[k], bool) for k in rewarmup)
    )
    if not ok or rewarmup["start"] < 0 or rewarmup["iters"] < 1:
        raise ValueError(f"rewarmup must be null or {{'start': int >= 0, 'iters': int >= 1}}, got {rewarmup!r}")
    return dict(rewarmup)


def with_rewarmup(state: dict, iters: int) -> dict:
    """A saved scheduler state with a re-warm-up of ``iters`` steps starting at its next step
    (what ``convert_checkpoint.py delink/grow --lr-rewarmup-iters`` records)."""
    if iters < 1:
        raise ValueError(f"--lr-rewarmup-iters must be >= 1, got {iters}")
    return {**state, "rewarmup": {"start": int(state.get("updates", 0)), "iters": int(iters)}}


class LRScheduler:
    """Sets every parameter group's LR; its state is the sample count ``num_steps``, the applied
    update count ``updates`` and the re-warm-up."""

    def __init__(self, optimizer, cfg: Config, world_size: int, num_steps: int = 0):
        self.optimizer, self.t, self.num_steps, self.updates = optimizer, cfg.train, num_steps, 0
        self.rewarmup: Optional[dict] = None
        self.warmup, self.decay = lr_lengths(cfg, world_size)
        self._apply()

    def _at(self, max_lr: float, min_lr: float) -> float:
        scheduled = learning_rate(self.num_steps, self.warmup, self.decay, self.t.lr_decay_style, max_lr, min_lr)
        return scheduled * rewarmup_factor(self.updates, self.rewarmup)

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
        self.updates += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "updates": self.updates, "rewarmup": self.rewarmup}

    def load_state_dict(self, state: dict) -> None:
        """``updates`` and ``rewarmup`` are optional (an imported checkpoint has neither)."""
        self.num_steps = int(state["num_steps"])
        self.updates = int(state.get("updates", 0))
        self.rewarmup = check_rewarmup(state.get("rewarmup"))
        self._apply()
