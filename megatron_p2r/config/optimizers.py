"""One record per ``--optimizer`` kind: the facts about it that validation, the layout's byte
accounting, the checkpoint and the planner read, so a new kind is one row here plus its kernel
(``optim/``) and the line that builds it (``optim/optimizer.py``'s ``BUILDERS``).

It lives in ``config`` because validation refuses the dtype flags a kind cannot honour and
``config`` depends on nothing else of the package; the kernels (torch code) stay in ``optim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megatron_p2r.config.fields import ConfigError

# The dtype flag of each moment of the weights' size an optimizer may keep.
MOMENT_FLAGS = {"exp_avg": "--exp-avg-dtype", "exp_avg_sq": "--exp-avg-sq-dtype"}
FACTOR_DTYPE = "fp32"  # the dtype of factored (per row and column) statistics


@dataclass(frozen=True)
class OptimizerSpec:
    """``name``: the ``--optimizer`` value; ``megatron``: Megatron-LM's value for the same
    optimizer (None: Megatron-LM has none); ``moments``: the state tensors of the weights' size it
    keeps, each stored in its ``MOMENT_FLAGS`` dtype; ``factored``: it keeps fp32 statistics per
    matrix row and column instead (Adafactor); ``checkpoint_entries``: its state entries in a
    checkpoint (``optimizer.<name>.<entry>``), the step count last; ``from_adam``: the entries it
    reads from an AdamW checkpoint that lacks its own, to start from AdamW's state (None: none);
    ``fp16_mains``: it steps ``--main-params-dtype fp16`` mains; ``unkept_moment``: why a dtype
    flag of a moment it does not keep is refused, and what to do instead; ``gradient_power``:
    each checkpoint entry (the step count aside) is a mean of the gradient to this power, so
    delinking with ``--optimizer-state rescale`` scales it by (M/N)^power (p2r/delink.py)."""

    name: str
    megatron: Optional[str]
    summary: str
    moments: Tuple[str, ...]
    checkpoint_entries: Tuple[str, ...]
    factored: bool = False
    from_adam: Optional[Tuple[str, ...]] = None
    fp16_mains: bool = False
    unkept_moment: str = ""
    gradient_power: Tuple[Tuple[str, int], ...] = ()

    def moment_dtypes(self, t) -> Dict[str, str]:
        """Moment name -> its dtype (the flags' names: fp32, bf16, fp16) under TrainConfig ``t``."""
        return {m: getattr(t, f"{m}_dtype") for m in self.moments}

    def check(self, t) -> None:
        """Refuse the dtype options this kind cannot honour (TrainConfig ``t``)."""
        if t.main_params_dtype == "fp16" and not self.fp16_mains:
            allowed = " or ".join(s.name for s in OPTIMIZERS.values() if s.fp16_mains)
            raise ConfigError(
                f"--main-params-dtype fp16 is built for --optimizer {allowed} only (got {self.name}), "
                "as Megatron-LM's precision-aware optimizer"
            )
        unkept = [
            f"{flag} {getattr(t, f'{m}_dtype')}"
            for m, flag in MOMENT_FLAGS.items()
            if m not in self.moments and getattr(t, f"{m}_dtype") != "fp32"
        ]
        if unkept:
            raise ConfigError(f"{', '.join(unkept)}: --optimizer {self.name} {self.unkept_moment}")


OPTIMIZERS: Dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec(
            "adam",
            "adam",
            "AdamW",
            moments=("exp_avg", "exp_avg_sq"),
            checkpoint_entries=("exp_avg", "exp_avg_sq", "step"),
            fp16_mains=True,
            gradient_power=(("exp_avg", 1), ("exp_avg_sq", 2)),
        ),
        # Lion's one moment is AdamW's first: its entries are in an AdamW checkpoint (the second is left).
        OptimizerSpec(
            "lion",
            None,
            "one fp32 moment: sign updates, Chen et al. 2023",
            moments=("exp_avg",),
            checkpoint_entries=("exp_avg", "step"),
            gradient_power=(("exp_avg", 1),),
            unkept_moment="keeps no second moment; lower its one moment with --exp-avg-dtype",
        ),
        # Adafactor makes its row and column statistics of AdamW's second moment (optim/state_io.py).
        OptimizerSpec(
            "adafactor",
            None,
            "factored second moments, Shazeer & Stern 2018",
            moments=(),
            factored=True,
            checkpoint_entries=("row_var", "col_var", "step"),
            from_adam=("exp_avg_sq", "step"),
            gradient_power=(("row_var", 2), ("col_var", 2)),
            unkept_moment="keeps no moments of the weights' size (its factored statistics are fp32); leave them fp32",
        ),
    )
}

# Checkpoint entry -> the power of the gradient it averages, over every kind (an entry means the
# same in every kind that keeps it: Lion's ``exp_avg`` is AdamW's first moment).
GRADIENT_POWER: Dict[str, int] = {entry: power for spec in OPTIMIZERS.values() for entry, power in spec.gradient_power}
