"""export-megatron's optimizer state: Adam's moments and step, the fp32 main weights under
--bf16, and the LR schedule's position, as megatron-core's non-distributed optimizer asks a
torch_dist checkpoint for them when Megatron-LM resumes (``MegatronOptimizer.sharded_state_dict``
builds them from the model's sharded keys with ``optim_state_to_sharding_state``):

    optimizer.state.exp_avg.KEY, optimizer.state.exp_avg_sq.KEY   each weight's moments, under the
                                        weight's own key, global shape and stacking
    optimizer.state.fp32_param.KEY      --bf16 (``Float16OptimizerWithFloat16Params``): the fp32 mains
    common.pt "optimizer"               {"state": {"common_step": step}, "param_groups": [...]};
                                        under --bf16 nested in {"optimizer": ...}; with experts
                                        under EP > 1 {0: the dense parameters', 1: the experts'}
    common.pt "opt_param_scheduler"     ``OptimizerParamScheduler.state_dict()``, in samples

The groups are Megatron's ``_get_param_groups`` for our model: weight decay, then no weight
decay (biases and 1-D parameters, ``wd_mult`` 0), the experts' apart under EP > 1, with AdamW's hyper-parameters (Megatron takes
``betas`` and ``eps`` from the checkpoint; its scheduler sets ``lr`` and ``weight_decay``). Their
``params`` are not saved: megatron-core keeps the loading run's (``LocalNonpersistentObject``),
matching the saved groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), so the
groups' number and keys must be Megatron's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.config import Config
from megatron_p2r.config.batch import global_batch_size, lr_lengths, train_iters
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.megatron.rules import Inverse
from megatron_p2r.optim.scheduler import learning_rate

MOMENTS = ("exp_avg", "exp_avg_sq")
# torch.optim.AdamW's group options as megatron-core builds it (Transformer Engine's and Apex's
# FusedAdam read ``bias_correction`` too)
_ADAM_OPTIONS = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
    bias_correction=True,
)
Inverses = Dict[str, Inverse]  # canonical Megatron tensor -> (our pieces, the function that makes it)


@dataclasses.dataclass
class OptimizerExport:
    """What the optimizer adds to a torch_dist checkpoint."""

    tensors: Dict[str, Dict[str, torch.Tensor]]  # kind (exp_avg, exp_avg_sq, main) -> canonical name -> tensor
    optimizer: dict  # common.pt's "optimizer"
    scheduler: dict  # common.pt's "opt_param_scheduler"


def not_exported(source: SourceCheckpoint, ckpt_format: str, dtype: str) -> Optional[str]:
    """Why the optimizer state of ``source`` is not written (weights only), or None."""
    t = source.real_cfg.train
    reasons = [
        (not source.meta["optimizer"], "the checkpoint has no optimizer state"),
        (ckpt_format != "torch_dist", "the optimizer state is written in torch_dist only"),
        (source.pseudo, "a pseudo-phase checkpoint's optimizer state is not delinked"),
        (dtype == "float16", "--dtype float16 needs Megatron's loss scaler state, not written"),
        (t.decoupled_lr is not None, "--decoupled-lr gives Megatron other parameter groups"),
        (
            t.apply_wd_to_qk_layernorm and source.real_cfg.model.qk_layernorm,
            "--apply-wd-to-qk-layernorm moves the query/key norms to Megatron's weight-decay group, not laid out",
        ),
        (t.optimizer != "adam", f"--optimizer {t.optimizer}'s state has no Megatron-LM counterpart"),
    ]
    return next((why for failed, why in reasons if failed), None)


def world_size_of(source: SourceCheckpoint) -> int:
    """The saving run's world size (recorded with its RNG states), else its model-parallel size."""
    rng = source.meta.get("rng") or {}
    par = source.cfg.parallel
    return rng.get("world_size") or par.tensor_model_parallel_size * par.pipeline_model_parallel_size


def scheduler_state(cfg: Config, num_steps: int, world_size: int) -> dict:
    """Megatron's ``OptimizerParamScheduler.state_dict()`` of our schedule at ``num_steps`` samples
    (``get_optimizer_param_scheduler``'s lengths; weight decay constant, as ours)."""
    t = cfg.train
    warmup, decay = lr_lengths(cfg, world_size)
    samples = (
        t.train_samples
        if t.train_samples is not None
        else train_iters(cfg, world_size) * global_batch_size(cfg, world_size)
    )
    return {
        "max_lr": t.lr,
        "lr_warmup_steps": warmup,
        "num_steps": num_steps,
        "lr_decay_style": t.lr_decay_style,
        "lr_decay_steps": decay,
        "min_lr": t.min_lr,
        "start_wd": t.weight_decay,
        "end_wd": t.weight_decay,
        "wd_incr_style": "constant",
        "wd_incr_steps": samples,
    }


def scheduler_flags(cfg: Config, world_size: int) -> List[str]:
    """The flags that make Megatron-LM's OptimizerParamScheduler equal ``scheduler_state``: on
    resume it compares every value (LR, minimum, style, warm-up and decay lengths, start/end weight
    decay, its increment style and length) and aborts on a difference. The lengths in the form the
    run gave them: samples, or iterations with the global batch size Megatron multiplies them by."""
    t = cfg.train
    flags = [
        "--lr",
        str(t.lr),
        "--min-lr",
        str(t.min_lr),
        "--lr-decay-style",
        t.lr_decay_style,
        "--weight-decay",
        str(t.weight_decay),
        "--weight-decay-incr-style",
        "constant",
    ]
    if t.train_samples is not None:
        flags += ["--train-samples", str(t.train_samples)]
        if t.lr_decay_samples is not None:
            flags += ["--lr-decay-samples", str(t.lr_decay_samples)]
        warmup = ["--lr-warmup-samples", str(t.lr_warmup_samples)]
    else:
        flags += [
            "--train-iters",
            str(train_iters(cfg, world_size)),
            "--global-batch-size",
            str(global_batch_size(cfg, world_size)),
        ]
        if t.lr_decay_iters is not None:
            flags += ["--lr-decay-iters", str(t.lr_decay_iters)]
        warmup = ["--lr-warmup-iters", str(t.lr_warmup_iters)]
    return flags + (["--lr-warmup-fraction", str(t.lr_warmup_fraction)] if t.lr_warmup_fraction is not None else warmup)


def param_groups(cfg: Config, lr: float, experts: bool) -> List[dict]:
    """Megatron's parameter groups (without ``params``) of the dense parameters or of the
    experts: weight decay, then none (``wd_mult`` 0: norms and biases; experts have it only with
    biases)."""
    t = cfg.train
    wd_mults = (1.0, 0.0) if not experts or cfg.model.add_bias else (1.0,)
    return [
        {
            "is_expert_parallel": experts,
            "default_config": True,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_decoupled_lr": False,
            "max_lr": t.lr,
            "min_lr": t.min_lr,
            "lr": lr,
            "betas": (t.adam_beta1, t.adam_beta2),
            "eps": t.adam_eps,
            "weight_decay": t.weight_decay * wd_mult,
            **_ADAM_OPTIONS,
        }
        for wd_mult in wd_mults
    ]


def _common_state(cfg: Config, step: float, lr: float, dtype: str, expert_parallel: bool) -> dict:
    """common.pt's ``optimizer``: megatron-core's optimizer of the dense parameters, and under
    expert parallelism (EP > 1: only then are the experts' parameters ``allreduce=False``) a
    ``ChainedOptimizer`` of it and the experts' ({0: dense, 1: experts})."""
    optimizers = []
    for experts in (False, True)[: 1 + expert_parallel]:
        state = {"state": {"common_step": torch.tensor(step)}, "param_groups": param_groups(cfg, lr, experts)}
        # Float16OptimizerWithFloat16Params nests torch's state dict
        optimizers.append({"optimizer": state} if dtype == "bfloat16" else state)
    return optimizers[0] if len(optimizers) == 1 else dict(enumerate(optimizers))


def optimizer_export(source: SourceCheckpoint, plan: Inverses, dtype: str, ep: int) -> OptimizerExport:
    """Every canonical Megatron tensor's moments (and fp32 main under --bf16), made from our
    pieces' by the weights' own reordering, with the common state of a Megatron run of EP ``ep``."""
    cfg = source.real_cfg
    kinds = MOMENTS + (("main",) if dtype == "bfloat16" else ())
    tensors: Dict[str, Dict[str, torch.Tensor]] = {kind: {} for kind in kinds}
    steps = set()
    for name, (keys, fn) in plan.items():
        for kind in kinds:
            pieces = [source.read(k, "model" if kind == "main" else kind).to(torch.float32) for k in keys]
            tensors[kind][name] = fn(pieces).contiguous()
        steps.update(float(source.read(k, "step")) for k in keys)
    if len(steps) != 1:
        raise CheckpointError(
            f"{source.iter_dir}: Adam steps {sorted(steps)} differ between parameters; Megatron keeps one common step"
        )
    scheduler = scheduler_state(cfg, int(source.meta["scheduler"]["num_steps"]), world_size_of(source))
    lr = learning_rate(
        scheduler["num_steps"],
        scheduler["lr_warmup_steps"],
        scheduler["lr_decay_steps"],
        cfg.train.lr_decay_style,
        cfg.train.lr,
        cfg.train.min_lr,
    )
    expert_parallel = bool(cfg.model.num_experts) and ep > 1
    return OptimizerExport(tensors, _common_state(cfg, steps.pop(), lr, dtype, expert_parallel), scheduler)
