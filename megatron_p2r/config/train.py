"""The train section: batch sizes, optimizer, schedule, precision and when to stop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import Range, at_least, fraction, positive


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = opt(4, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = opt(None, "Samples per optimizer step (default micro-batch x DP).")
    train_iters: int = opt(10, "Optimizer steps to train.")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(0.0, "Learning rate at the end of decay.")
    lr_warmup_iters: int = opt(0, "Linear warm-up steps.")
    lr_decay_iters: Optional[int] = opt(None, "Steps over which to decay (default train-iters).")
    lr_decay_style: str = opt("cosine", "Decay after warm-up.", choices=["cosine", "linear", "constant"])
    weight_decay: float = opt(0.01, "AdamW weight decay (not applied to norms and biases).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = opt(1234, "Seed of initialisation, data order and dropout.")
    bf16: bool = opt(False, "bfloat16 compute (fp32 master weights).")
    fp16: bool = opt(False, "float16 compute with dynamic loss scaling (fp32 master weights).")
    initial_loss_scale: float = opt(2.0 ** 16, "fp16: starting loss scale.")
    min_loss_scale: float = opt(1.0, "fp16: smallest loss scale.")
    loss_scale_window: int = opt(1000, "fp16: grow the scale after this many finite steps.")
    recompute_activations: bool = opt(False, "Recompute each layer's activations in backward.")
    max_skipped_steps: int = opt(10, "Stop after this many consecutive steps skipped for non-finite values.")
    exit_interval: Optional[int] = opt(None, "Save and exit when the iteration is a multiple of this.")
    exit_signal_handler: bool = opt(False, "Save and exit cleanly on SIGTERM.")

    def check(self) -> None:
        """The rules between the section's fields (each field's range: ``RANGES``)."""
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale ({self.min_loss_scale}) must be <= --initial-loss-scale "
                              f"({self.initial_loss_scale})")


# Type and range of every numeric field (config/ranges.py); the rules between fields are in ``check``.
RANGES = {
    "micro_batch_size": at_least(1, 2 ** 24), "global_batch_size": at_least(1, 2 ** 30), "train_iters": at_least(0),
    "lr": Range(0.0), "min_lr": Range(0.0), "lr_warmup_iters": at_least(0), "lr_decay_iters": at_least(1),
    "weight_decay": Range(0.0), "adam_beta1": fraction(), "adam_beta2": fraction(), "adam_eps": positive(),
    "clip_grad": Range(0.0), "seed": at_least(0, 2 ** 31 - 1),  # numpy's RandomState takes < 2^32, offsets added
    "initial_loss_scale": positive(), "min_loss_scale": positive(), "loss_scale_window": at_least(1),
    "max_skipped_steps": at_least(1), "exit_interval": at_least(1),
}
