"""The checkpoint section: where to save and load, and how often."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import opt, require_at_least_one


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = opt(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = opt(None, "Save every N iterations.")
    load: Optional[str] = opt(None, "Directory to resume from.")
    finetune: bool = opt(False, "Load weights only: fresh optimizer, iteration 0.")
    no_load_optim: bool = opt(False, "Do not load optimizer state.")
    no_load_rng: bool = opt(False, "Do not load RNG state.")
    keep_last: Optional[int] = opt(None, "Keep only the newest N complete checkpoints.")

    def check(self) -> None:
        require_at_least_one(("--save-interval", self.save_interval), ("--keep-last", self.keep_last),
                             unset_disables=True)
