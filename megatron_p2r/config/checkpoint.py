"""The checkpoint section: where to save and load, and how often."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import opt
from megatron_p2r.config.ranges import at_least


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = opt(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = opt(None, "Save every N iterations.")
    load: Optional[str] = opt(None, "Directory to resume from.")
    finetune: bool = opt(False, "Load weights only: fresh optimizer, iteration 0.")
    no_load_optim: bool = opt(False, "Do not load optimizer state.")
    no_load_rng: bool = opt(False, "Do not load RNG state.")
    keep_last: Optional[int] = opt(None, "Keep only the newest N complete checkpoints.")
    ckpt_fully_parallel_save: bool = opt(True, "Every data-parallel rank writes what it owns (its shard of the "
                                         "distributed optimizer's state, or its share of the tensors) into files of "
                                         "its own; --no-ckpt-fully-parallel-save keeps one writer per model-parallel "
                                         "shard.")
    ckpt_fully_parallel_load: bool = opt(False, "Each rank reads only the optimizer-state fragments it steps, not "
                                         "whole tensors (the weights are read whole: every rank holds them).")


# Type and range of every numeric field (config/ranges.py).
RANGES = {"save_interval": at_least(1), "keep_last": at_least(1, 2 ** 20)}
