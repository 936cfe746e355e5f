"""Weights & Biases for a training run, with Megatron-LM's flags (``--wandb-project``,
``--wandb-exp-name``, ``--wandb-save-dir``, ``--wandb-entity``).

The run is opened on the rank that writes the JSONL/TensorBoard log (the last pipeline stage,
where the loss is), with the whole config and the planner's estimate of this run as its config;
every logged record goes to its history unchanged, one row per record, charted against
``iteration``. ``wandb`` is an optional dependency (``pip install megatron_p2r[wandb]``);
``WANDB_MODE=offline`` writes the run locally for ``wandb sync`` later.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_p2r.config import Config, ConfigError
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.preflight import rank_memory


def planner_summary(cfg: Config, plan: ParallelPlan, device_type: str) -> dict:
    """What the planner says of this run: its layout and the memory each pipeline stage's rank
    needs (bytes; on CPU all of it is host memory)."""
    layout = plan.layout
    return {
        "world_size": layout.world_size,
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "dp": layout.dp,
        "ep": layout.ep,
        "phase": plan.phase,
        "device_type": device_type,
        "memory_per_rank_bytes": {f"stage_{s}": rank_memory(cfg, plan, s, device_type) for s in range(layout.pp)},
    }


class WandbWriter:
    """One W&B run: ``log`` adds a history row, ``close`` finishes it."""

    def __init__(self, run):
        self.run = run

    @classmethod
    def open(cls, cfg: Config, plan: ParallelPlan, device_type: str) -> Optional["WandbWriter"]:
        """The run ``cfg`` asks for, or None without --wandb-project (or with WANDB_MODE=disabled)."""
        lg = cfg.logging
        if not lg.uses_wandb:
            return None
        cfg.logging.check(cfg.checkpoint.save)
        import wandb

        save_dir = lg.wandb_save_dir or os.path.join(cfg.checkpoint.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        try:
            run = wandb.init(
                project=lg.wandb_project,
                name=lg.wandb_exp_name,
                entity=lg.wandb_entity or None,
                dir=save_dir,
                config={**cfg.to_dict(), "planner": planner_summary(cfg, plan, device_type)},
            )
        except wandb.errors.Error as exc:  # no API key, no network: say what to do, no traceback
            raise ConfigError(
                f"--wandb-project {lg.wandb_project}: wandb cannot start the run ({exc}); log in "
                "(wandb login, WANDB_API_KEY) or set WANDB_MODE=offline and `wandb sync` later"
            ) from None
        run.define_metric("iteration")
        run.define_metric("*", step_metric="iteration")
        return cls(run)

    def log(self, record: dict) -> None:
        self.run.log(dict(record))

    def close(self) -> None:
        self.run.finish()
