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
    exit_on_missing_checkpoint: bool = opt(
        False,
        "With --load the --save directory and no checkpoint in it yet, "
        "exit (status 0) instead of starting from scratch (a --load elsewhere "
        "without a checkpoint is always an error here).",
    )
    keep_last: Optional[int] = opt(None, "Keep only the newest N complete checkpoints.")
    ckpt_fully_parallel_save: bool = opt(
        True,
        "Every data-parallel rank writes what it owns (its shard of the "
        "distributed optimizer's state, or its share of the tensors) into files of "
        "its own; --no-ckpt-fully-parallel-save keeps one writer per model-parallel "
        "shard.",
    )
    async_save: bool = opt(
        False,
        "Write checkpoints in the background: each rank copies what it writes to host "
        "memory and a writer thread writes it while training continues; the checkpoint is "
        "published at the next save or at exit (needs the fully parallel save, as Megatron-LM's "
        "needs its torch_dist format).",
    )
    ckpt_fully_parallel_load: bool = opt(
        False,
        "Each rank reads only the optimizer-state fragments it steps, not "
        "whole tensors (the weights are read whole: every rank holds them).",
    )


# Type and range of every numeric field (config/ranges.py).
RANGES = {"save_interval": at_least(1), "keep_last": at_least(1, 2**20)}
