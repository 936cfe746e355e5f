"""Loss scaling. fp16 needs a dynamic scale; bf16 and fp32 use a constant scale of 1.

Dynamic scaling is Megatron-LM's ``DynamicGradScaler``: halve after ``--hysteresis`` non-finite
steps in a row (and after every further one until the scale grows again), double after
``--loss-scale-window`` finite steps in a row. The non-finite check
(``parallel.grads.grad_norm_and_non_finite``) is reduced over *all* ranks before anyone decides,
so every rank skips the same steps.
"""

from __future__ import annotations

from megatron_p2r.config import TrainConfig


class LossScaler:
    def __init__(self, t: TrainConfig):
        self.dynamic = t.fp16
        self.scale = float(t.initial_loss_scale) if t.fp16 else 1.0
        self.min_scale, self.window = float(t.min_loss_scale), int(t.loss_scale_window)
        self.hysteresis = int(t.hysteresis)
        self.good_steps, self.hysteresis_left = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.good_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
