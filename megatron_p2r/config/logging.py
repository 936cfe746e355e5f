"""The logging section: log lines, JSONL, TensorBoard and evaluation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import opt
from megatron_p2r.config.ranges import at_least


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = opt(100, "Log every N iterations.")
    log_file: Optional[str] = opt(None, "Append one JSON object per logged iteration here.")
    tensorboard_dir: Optional[str] = opt(None, "Write the logged scalars for TensorBoard here.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N iterations.")
    eval_iters: int = opt(100, "Batches per evaluation (a fixed, deterministic set); 0: no validation set and no "
                          "evaluation, whatever --eval-interval says (Megatron-LM's meaning).")
    eval_only: bool = opt(False, "Load, evaluate the validation loss, exit.")

    @property
    def evaluates(self) -> bool:
        """Whether training evaluates on --eval-interval (Megatron-LM's ``do_valid``)."""
        return bool(self.eval_interval and self.eval_iters)


# Type and range of every numeric field (config/ranges.py).
RANGES = {"log_interval": at_least(1), "eval_interval": at_least(1), "eval_iters": at_least(0, 2 ** 24)}
