"""The train section: batch sizes, optimizer, schedule, precision and when to stop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from megatron_p2r.config.fields import ConfigError, opt, require_at_least_one, require_positive


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
    recompute_activations: bool = opt(False, "Selective recomputation (--recompute-granularity selective): "
                                             "the attention core is recomputed in backward.")
    recompute_granularity: Optional[str] = opt(None, "full: recompute whole layers (with --recompute-method); "
                                                     "selective: the attention core only.",
                                               choices=["full", "selective"])
    recompute_method: Optional[str] = opt(None, "full recomputation: uniform (every chunk of "
                                                "--recompute-num-layers layers) or block (the first "
                                                "--recompute-num-layers layers of each stage).",
                                          choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = opt(None, "Layers per recomputed chunk (uniform) or recomputed "
                                                    "layers per pipeline stage (block).")
    max_skipped_steps: int = opt(10, "Stop after this many consecutive steps skipped for non-finite values.")
    exit_interval: Optional[int] = opt(None, "Save and exit when the iteration is a multiple of this.")
    exit_signal_handler: bool = opt(False, "Save and exit cleanly on SIGTERM.")

    def check(self) -> None:
        """Values outside their range (each crashed deep inside a run, or silently misbehaved)."""
        require_at_least_one(("--micro-batch-size", self.micro_batch_size),
                             ("--global-batch-size", self.global_batch_size),
                             ("--max-skipped-steps", self.max_skipped_steps),
                             ("--loss-scale-window", self.loss_scale_window))
        require_at_least_one(("--exit-interval", self.exit_interval), unset_disables=True)
        if self.train_iters < 0:
            raise ConfigError(f"--train-iters must be >= 0, got {self.train_iters}")
        require_positive(("--initial-loss-scale", self.initial_loss_scale), ("--min-loss-scale", self.min_loss_scale))
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive")
        self._check_recompute()
        if self.lr_warmup_iters < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need --lr-warmup-iters >= 0 and --min-lr ({self.min_lr}) <= --lr ({self.lr})")

    @property
    def recompute(self) -> Optional[str]:
        """The recomputation granularity in effect: --recompute-activations means selective (as in
        Megatron-LM); None when nothing is recomputed."""
        return "selective" if self.recompute_activations else self.recompute_granularity

    def _check_recompute(self) -> None:
        """Megatron-LM's rules: full needs a method and a layer count, selective takes neither."""
        if self.recompute_activations and self.recompute_granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective; "
                              "it conflicts with --recompute-granularity full")
        if self.recompute == "full" and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ConfigError("--recompute-granularity full needs --recompute-method (uniform|block) and "
                              "--recompute-num-layers N")
        if self.recompute != "full" and (self.recompute_method is not None or self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers apply to --recompute-granularity "
                              f"full only (granularity: {self.recompute})")
        require_at_least_one(("--recompute-num-layers", self.recompute_num_layers))

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
