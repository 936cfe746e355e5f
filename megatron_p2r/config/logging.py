"""The logging section: log lines, JSONL, TensorBoard and evaluation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import opt, require_at_least_one


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = opt(100, "Log every N iterations.")
    log_file: Optional[str] = opt(None, "Append one JSON object per logged iteration here.")
    tensorboard_dir: Optional[str] = opt(None, "Write the logged scalars for TensorBoard here.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N iterations.")
    eval_iters: int = opt(100, "Batches per evaluation (a fixed, deterministic set).")
    eval_only: bool = opt(False, "Load, evaluate the validation loss, exit.")

    def check(self) -> None:
        require_at_least_one(("--log-interval", self.log_interval), ("--eval-iters", self.eval_iters))
        require_at_least_one(("--eval-interval", self.eval_interval), unset_disables=True)
