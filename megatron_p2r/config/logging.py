"""The logging section: log lines, JSONL, TensorBoard and evaluation."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import at_least


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = opt(100, "Log every N iterations.")
    log_file: Optional[str] = opt(None, "Append one JSON object per logged iteration here.")
    tensorboard_dir: Optional[str] = opt(None, "Write the logged scalars for TensorBoard here.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N iterations.")
    eval_iters: int = opt(
        100,
        "Batches per evaluation (a fixed, deterministic set); 0: no validation set and no "
        "evaluation, whatever --eval-interval says (Megatron-LM's meaning).",
    )
    eval_only: bool = opt(False, "Load, evaluate the validation loss, exit.")
    wandb_project: Optional[str] = opt(None, "Weights & Biases project: log the run there (docs/monitoring.md).")
    wandb_exp_name: Optional[str] = opt(None, "Weights & Biases run name (needed with --wandb-project).")
    wandb_save_dir: Optional[str] = opt(None, "Where the W&B run's files go (default SAVE/wandb).")
    wandb_entity: Optional[str] = opt(None, "Weights & Biases team or user (default: the account's).")
    log_params_norm: bool = opt(
        False,
        "Log the L2 norm of all parameters (fp32 mains, each shared or replicated one once) (docs/monitoring.md).",
    )
    log_num_zeros_in_grad: bool = opt(False, "Log how many gradient elements are zero, over all ranks.")
    tensorboard_log_interval: int = opt(
        1, "Write the step's scalars to TensorBoard under Megatron-LM's names every N iterations."
    )
    log_memory_to_tensorboard: bool = opt(
        False, "Memory scalars to TensorBoard (CUDA allocator statistics; on CPU the process's resident memory)."
    )
    log_timers_to_tensorboard: bool = opt(
        False, "Iteration time, throughput and the --timing-log-level timers in the log records."
    )
    log_validation_ppl_to_tensorboard: bool = opt(False, "Log the validation perplexity exp(min(20, loss)) too.")
    timing_log_level: int = opt(
        0,
        "0: iteration time only; 1: also once-per-step phases (forward-backward, gradient sync, "
        "optimizer); 2: also the batch generator (docs/monitoring.md).",
        choices=[0, 1, 2],
    )

    def check(self, save: Optional[str]) -> None:
        """Megatron's W&B rules, on every rank before anything is built: a run name, a directory
        for its files, and the optional package installed."""
        if not self.uses_wandb:
            return
        if not self.wandb_exp_name:
            raise ConfigError("--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
        if not (self.wandb_save_dir or save):
            raise ConfigError("--wandb-project needs --wandb-save-dir or --save (the run's files go to SAVE/wandb)")
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project needs the wandb package: pip install megatron_p2r[wandb]")

    @property
    def uses_wandb(self) -> bool:
        """--wandb-project given, and W&B not turned off by wandb's own ``WANDB_MODE=disabled``
        (which needs no package: a launch script's W&B branch can stay as it is)."""
        return bool(self.wandb_project) and os.environ.get("WANDB_MODE") != "disabled"

    @property
    def evaluates(self) -> bool:
        """Whether training evaluates on --eval-interval (Megatron-LM's ``do_valid``)."""
        return bool(self.eval_interval and self.eval_iters)


# Type and range of every numeric field (config/ranges.py).
RANGES = {
    "log_interval": at_least(1),
    "tensorboard_log_interval": at_least(1),
    "timing_log_level": at_least(0, 2),
    "eval_interval": at_least(1),
    "eval_iters": at_least(0, 2**24),
}
