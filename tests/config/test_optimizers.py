"""The optimizer specs: one row per --optimizer kind, read by validation, the kernels' builder,
the byte accounting and the checkpoint."""

from __future__ import annotations

from megatron_p2r.config import OPTIMIZERS
from megatron_p2r.optim.optimizer import BUILDERS, OPTIMIZER_KINDS
from megatron_p2r.optim.traffic import kernel_bytes_per_element
from tests.helpers import tiny_config


def test_every_spec_has_a_kernel_and_the_flag_offers_every_spec():
    assert set(BUILDERS) == set(OPTIMIZERS)
    from megatron_p2r.config.train import TrainConfig
    from dataclasses import fields

    choices = next(f for f in fields(TrainConfig) if f.name == "optimizer").metadata.get("choices")
    assert choices == list(OPTIMIZERS)


def test_checkpoint_entries_keep_their_names():
    """Checkpoints written before the specs existed name these entries (optimizer.<kind>.<entry>)."""
    assert OPTIMIZER_KINDS == {
        "adam": ("exp_avg", "exp_avg_sq", "step"),
        "lion": ("exp_avg", "step"),
        "adafactor": ("row_var", "col_var", "step"),
    }


def test_moment_dtypes_come_from_the_spec():
    t = tiny_config(use_precision_aware_optimizer=True, exp_avg_dtype="bf16").train
    assert OPTIMIZERS["adam"].moment_dtypes(t) == {"exp_avg": "bf16", "exp_avg_sq": "fp32"}
    assert tiny_config(optimizer="lion").train.moment_dtypes == ("fp32",)
    assert tiny_config(optimizer="adafactor").train.moment_dtypes == ()


def test_kernel_traffic_follows_the_spec():
    fp32 = dict(main="fp32", grad="fp32", weight=None)
    assert kernel_bytes_per_element("adam", moments={"exp_avg": "fp32", "exp_avg_sq": "fp32"}, **fp32) == 28
    assert kernel_bytes_per_element("lion", moments={"exp_avg": "fp32"}, **fp32) == 20
    assert kernel_bytes_per_element("adafactor", moments={}, **fp32) == 20  # 3 gradient reads, main read + written


def test_every_entry_has_one_delink_rule():
    """Each checkpoint entry but the step count says how delinking rescales it, the same in every kind."""
    from megatron_p2r.config.optimizers import GRADIENT_POWER

    for spec in OPTIMIZERS.values():
        powers = dict(spec.gradient_power)
        assert set(powers) == set(spec.checkpoint_entries) - {"step"}, spec.name
        assert all(GRADIENT_POWER[entry] == power for entry, power in powers.items()), spec.name
