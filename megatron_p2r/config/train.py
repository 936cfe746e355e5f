"""The train section: batch sizes, optimizer, schedule, precision and when to stop."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.optimizers import OPTIMIZERS
from megatron_p2r.config.ranges import LAYERS, Range, at_least, fraction, positive


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = opt(4, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = opt(
        None, "Samples per optimizer step (default micro-batch x DP; the final one with a batch-size schedule)."
    )
    rampup_batch_size: Optional[List[int]] = opt(
        None,
        "START INCR SAMPLES: grow the global batch from START by INCR over SAMPLES samples (Megatron core_v0.17).",
        nargs=3,
    )
    step_batch_size_schedule: Optional[List[str]] = opt(
        None, "Global batch by consumed tokens: THRESHOLD:SIZE ..., e.g. 0:16 2.4B:320 (suffixes K M B T).", nargs="+"
    )
    train_iters: Optional[int] = opt(None, "Optimizer steps to train (or --train-samples).")
    train_samples: Optional[int] = opt(None, "Samples to train on (or --train-iters).")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(0.0, "Learning rate at the end of decay.")
    decoupled_lr: Optional[float] = opt(None, "Peak learning rate of the input embedding and output layer.")
    decoupled_min_lr: Optional[float] = opt(None, "Their learning rate at the end of decay (default --min-lr).")
    lr_warmup_iters: int = opt(0, "Linear warm-up steps (from 0).")
    lr_warmup_samples: int = opt(0, "Linear warm-up samples (with --train-samples).")
    lr_warmup_fraction: Optional[float] = opt(None, "Warm-up as a fraction of the decay length.")
    lr_decay_iters: Optional[int] = opt(None, "Steps over which to decay (default train-iters).")
    lr_decay_samples: Optional[int] = opt(None, "Samples over which to decay (default train-samples).")
    lr_decay_style: str = opt("linear", "Decay after warm-up.", choices=["cosine", "linear", "constant"])
    optimizer: str = opt(
        "adam",
        "; ".join(f"{s.name} ({s.summary})" for s in OPTIMIZERS.values())
        + " (config/optimizers.py; the memory-lean ones: docs/scale.md).",
        choices=list(OPTIMIZERS),
    )
    weight_decay: float = opt(0.01, "Decoupled weight decay (not applied to norms and biases).")
    apply_wd_to_qk_layernorm: bool = opt(
        False,
        "Weight decay on the query/key norms (--qk-layernorm) too, as "
        "megatron-core's Qwen3-Next grouping: other norms and biases still have none.",
    )
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.999, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    lion_beta1: float = opt(0.95, "Lion: weight of the moment in the update's sign (beta1; Megatron-LM's default).")
    lion_beta2: float = opt(0.98, "Lion: decay of the moment (beta2; Megatron-LM's default).")
    adafactor_beta2_decay: float = opt(
        -0.8, "Adafactor: the second moments' decay is 1 - t^this (torch's beta2_decay)."
    )
    adafactor_eps2: float = opt(1e-3, "Adafactor: the smallest relative step scale (torch's eps[1]).")
    adafactor_clip_threshold: float = opt(1.0, "Adafactor: update RMS clipping threshold (torch's d).")
    use_precision_aware_optimizer: bool = opt(
        False, "Allow optimizer state below fp32 (the dtype flags that follow; Megatron-LM's name)."
    )
    main_grads_dtype: str = opt(
        "fp32",
        "Dtype of the main gradients: the DDP buffers micro-batch gradients "
        "accumulate in and are reduced in (precision-aware optimizer).",
        choices=["fp32", "bf16"],
    )
    main_params_dtype: str = opt(
        "fp32",
        "Dtype of the main parameters the optimizer steps (precision-aware "
        "optimizer; fp16 needs --bf16 or --fp16 weights and --optimizer adam).",
        choices=["fp32", "fp16"],
    )
    exp_avg_dtype: str = opt(
        "fp32",
        "Dtype AdamW's first moment is stored in (precision-aware optimizer).",
        choices=["fp32", "fp16", "bf16", "fp8"],
    )
    exp_avg_sq_dtype: str = opt(
        "fp32",
        "Dtype AdamW's second moment is stored in (precision-aware optimizer).",
        choices=["fp32", "fp16", "bf16", "fp8"],
    )
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = opt(1234, "Seed of initialisation, data order and dropout.")
    bf16: bool = opt(False, "bfloat16 parameters and compute; fp32 gradients and fp32 master weights in the optimizer.")
    fp16: bool = opt(False, "float16 parameters and compute with dynamic loss scaling; fp32 gradients and masters.")
    initial_loss_scale: float = opt(2.0**32, "fp16: starting loss scale.")
    min_loss_scale: float = opt(1.0, "fp16: smallest loss scale.")
    loss_scale_window: int = opt(1000, "fp16: grow the scale after this many finite steps.")
    hysteresis: int = opt(2, "fp16: halve the scale after this many non-finite steps in a row.")
    recompute_activations: bool = opt(
        False,
        "Selective recomputation (--recompute-granularity selective): the attention core is recomputed in backward.",
    )
    recompute_granularity: Optional[str] = opt(
        None,
        "full: recompute whole layers (with --recompute-method); selective: the attention core only.",
        choices=["full", "selective"],
    )
    recompute_method: Optional[str] = opt(
        None,
        "full recomputation: uniform (every chunk of "
        "--recompute-num-layers layers) or block (the first "
        "--recompute-num-layers layers of each stage).",
        choices=["uniform", "block"],
    )
    recompute_num_layers: Optional[int] = opt(
        None, "Layers per recomputed chunk (uniform) or recomputed layers per pipeline stage (block)."
    )
    compile: bool = opt(
        False,
        "torch.compile each transformer layer's forward (one graph per layer where it traces "
        "whole, else in pieces around the graph breaks, logged); parameter names and checkpoints are "
        "unchanged.",
    )
    max_skipped_steps: int = opt(10, "Stop after this many consecutive steps skipped for non-finite values.")
    exit_interval: Optional[int] = opt(None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[int] = opt(None, "Save and exit after this many minutes.")
    exit_signal_handler: bool = opt(False, "Save and exit cleanly on --exit-signal.")
    exit_signal: str = opt(
        "SIGTERM",
        "The signal --exit-signal-handler catches (by name, as Megatron-LM takes it).",
        choices=[sig.name for sig in signal.Signals],
    )

    def check(self) -> None:
        """The rules between the section's fields (each field's range: ``RANGES``)."""
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"--min-loss-scale ({self.min_loss_scale}) must be <= --initial-loss-scale ({self.initial_loss_scale})"
            )
        self._check_schedule_units()
        self._check_batch_schedule()
        self._check_decoupled_lr()
        self._check_recompute()
        self._check_precision_aware()
        OPTIMIZERS[self.optimizer].check(self)

    def _check_schedule_units(self) -> None:
        """Iterations or samples, not both (Megatron-LM's rules)."""
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError("--train-iters and --train-samples are mutually exclusive")
        units = "iters" if self.train_samples is None else "samples"
        other = {"iters": "samples", "samples": "iters"}[units]
        if getattr(self, f"lr_decay_{other}") is not None or getattr(self, f"lr_warmup_{other}"):
            raise ConfigError(
                f"--lr-decay-{other} / --lr-warmup-{other} need --train-{other}; this run counts in "
                f"{units} (--train-{units}): use --lr-decay-{units} / --lr-warmup-{units}"
            )
        if self.lr_warmup_fraction is not None and getattr(self, f"lr_warmup_{units}"):
            raise ConfigError(f"--lr-warmup-fraction and --lr-warmup-{units} are mutually exclusive")

    def _check_batch_schedule(self) -> None:
        if self.rampup_batch_size is None:
            return
        if self.step_batch_size_schedule is not None:
            raise ConfigError("--rampup-batch-size and --step-batch-size-schedule are mutually exclusive")
        if self.train_samples is None:
            raise ConfigError("--rampup-batch-size needs sample-based training (--train-samples), as in Megatron-LM")

    def _check_decoupled_lr(self) -> None:
        if self.decoupled_min_lr is None:
            return
        if self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_min_lr > self.decoupled_lr:
            raise ConfigError(
                f"need --decoupled-min-lr ({self.decoupled_min_lr}) <= --decoupled-lr ({self.decoupled_lr})"
            )

    def _check_precision_aware(self) -> None:
        """Megatron-LM's rule: state dtypes other than fp32 need --use-precision-aware-optimizer.
        fp8 moments are refused by name; fp16 mains need 16-bit weights (fp32 weights are their
        own mains); what each --optimizer refuses is its spec's (config/optimizers.py)."""
        dtypes = {
            "--main-grads-dtype": self.main_grads_dtype,
            "--main-params-dtype": self.main_params_dtype,
            "--exp-avg-dtype": self.exp_avg_dtype,
            "--exp-avg-sq-dtype": self.exp_avg_sq_dtype,
        }
        lowered = [f"{flag} {dtype}" for flag, dtype in dtypes.items() if dtype != "fp32"]
        if lowered and not self.use_precision_aware_optimizer:
            raise ConfigError(
                f"{', '.join(lowered)} needs --use-precision-aware-optimizer (without it every "
                "optimizer state dtype is fp32, as in Megatron-LM)"
            )
        for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
            if dtypes[flag] == "fp8":
                raise ConfigError(
                    f"{flag} fp8 is not built (it needs per-tensor scaled fp8 moments); choose fp32, fp16 or bf16"
                )
        if self.main_params_dtype == "fp32":
            return
        if not (self.bf16 or self.fp16):
            raise ConfigError(
                "--main-params-dtype fp16 needs 16-bit weights (--bf16 or --fp16): fp32 weights are "
                "their own main parameters"
            )

    @property
    def moment_dtypes(self) -> Tuple[str, ...]:
        """The dtype of each moment of the weights' size ``--optimizer`` keeps (its spec's moments:
        AdamW's two, Lion's one, none for Adafactor's factored statistics)."""
        return tuple(OPTIMIZERS[self.optimizer].moment_dtypes(self).values())

    @property
    def recompute(self) -> Optional[str]:
        """The recomputation granularity in effect: --recompute-activations means selective (as in
        Megatron-LM); None when nothing is recomputed."""
        return "selective" if self.recompute_activations else self.recompute_granularity

    def _check_recompute(self) -> None:
        """Megatron-LM's rules: full needs a method and a layer count, selective takes neither."""
        if self.recompute_activations and self.recompute_granularity == "full":
            raise ConfigError(
                "--recompute-activations means --recompute-granularity selective; "
                "it conflicts with --recompute-granularity full"
            )
        if self.recompute == "full" and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ConfigError(
                "--recompute-granularity full needs --recompute-method (uniform|block) and --recompute-num-layers N"
            )
        if self.recompute != "full" and (self.recompute_method is not None or self.recompute_num_layers is not None):
            raise ConfigError(
                "--recompute-method and --recompute-num-layers apply to --recompute-granularity "
                f"full only (granularity: {self.recompute})"
            )

    def recompute_units(self, num_layers: int, standalone: Iterable[int] = ()) -> List[Tuple[List[int], bool]]:
        """A stage's ``num_layers`` layers (positions) as consecutive units run together, and
        whether each unit is recomputed in full: uniform makes every chunk of N layers one
        recomputed unit; block recomputes the first N layers one by one and keeps the rest.
        ``standalone`` layers recompute themselves (offloaded): they run alone, and the layers
        of their chunk around them stay recomputed."""
        if self.recompute != "full":
            return [([i], False) for i in range(num_layers)]
        n, alone = self.recompute_num_layers, set(standalone)
        if self.recompute_method == "block":
            return [([i], i < n and i not in alone) for i in range(num_layers)]
        units = []
        for start in range(0, num_layers, n):
            run: List[int] = []
            for i in range(start, min(start + n, num_layers)):
                if i in alone:
                    units += [(run, True)] if run else []
                    units.append(([i], False))
                    run = []
                else:
                    run.append(i)
            units += [(run, True)] if run else []
        return units


# Type and range of every numeric field (config/ranges.py); the rules between fields are in ``check``.
RANGES = {
    "micro_batch_size": at_least(1, 2**24),
    "global_batch_size": at_least(1, 2**30),
    # each of START INCR SAMPLES (the rules between them and --global-batch-size: batch.rampup_steps)
    "rampup_batch_size": at_least(0),
    "train_iters": at_least(0),
    "train_samples": at_least(0),
    "lr": Range(0.0),
    "min_lr": Range(0.0),
    "decoupled_lr": Range(0.0),
    "decoupled_min_lr": Range(0.0),
    "lr_warmup_iters": at_least(0),
    "lr_warmup_samples": at_least(0),
    "lr_warmup_fraction": fraction(),
    "lr_decay_iters": at_least(1),
    "lr_decay_samples": at_least(1),  # Megatron asserts a decay of > 0 steps
    "weight_decay": Range(0.0),
    "adam_beta1": fraction(),
    "adam_beta2": fraction(),
    "adam_eps": positive(),
    "lion_beta1": fraction(),
    "lion_beta2": fraction(),
    "adafactor_beta2_decay": Range(None, 0.0),
    "adafactor_eps2": Range(0.0),
    "adafactor_clip_threshold": Range(1.0),
    "clip_grad": Range(0.0),
    "seed": at_least(0, 2**31 - 1),  # numpy's RandomState takes < 2^32, offsets added
    "initial_loss_scale": positive(),
    "min_loss_scale": positive(),
    "loss_scale_window": at_least(1),
    "hysteresis": at_least(1),
    "max_skipped_steps": at_least(1),
    "exit_interval": at_least(1),
    "exit_duration_in_mins": at_least(1),
    "recompute_num_layers": at_least(1, LAYERS),
}
