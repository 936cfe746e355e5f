"""The optimizer's parameter groups, the kernel each ``--optimizer`` spec names (AdamW, Lion,
Adafactor: ``BUILDERS``; the kinds' facts are ``config/optimizers.py``'s),
and the wrapper that keeps its state on host for weights that stay on the device
(``--cpu-offload-what optimizer``).

Norms and biases (``no_wd``) get no weight decay. What the optimizer steps — the model's own fp32
weights, fp32 copies of 16-bit weights, or shards of either under the distributed optimizer —
is ``mixed_precision.py``'s concern: it steps, in each group, the main parameters of the
group's weights.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from megatron_p2r.config import OPTIMIZERS, TrainConfig
from megatron_p2r.layout.tensor_specs import OUTPUT_WEIGHT, WORD_EMBEDDING
from megatron_p2r.optim.adafactor import Adafactor
from megatron_p2r.optim.lion import Lion
from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW, moment_dtypes
from megatron_p2r.parallel.sharding import logical_name

# The state entries each --optimizer writes into checkpoints (``optimizer.<kind>.<piece>``), from
# its spec (config/optimizers.py). AdamW's are also those of checkpoints that list none.
OPTIMIZER_KINDS = {name: spec.checkpoint_entries for name, spec in OPTIMIZERS.items()}


def _qk_norm(name: str) -> bool:
    """A parameter of a query/key norm (megatron-core's test: q_layernorm. / k_layernorm. in the name)."""
    return "q_layernorm." in name or "k_layernorm." in name


def param_groups(model: nn.Module, t: TrainConfig) -> list:
    groups = {}
    for name, p in model.named_parameters():
        no_wd = getattr(p, "no_wd", False) and not (t.apply_wd_to_qk_layernorm and _qk_norm(name))
        decoupled = t.decoupled_lr is not None and logical_name(name, p) in (WORD_EMBEDDING, OUTPUT_WEIGHT)
        if (no_wd, decoupled) not in groups:
            groups[no_wd, decoupled] = {"params": [], "weight_decay": 0.0 if no_wd else t.weight_decay}
            if decoupled:
                groups[no_wd, decoupled].update(
                    max_lr=t.decoupled_lr, min_lr=t.decoupled_min_lr if t.decoupled_min_lr is not None else t.min_lr
                )
        groups[no_wd, decoupled]["params"].append(p)
    return [groups[key] for key in sorted(groups)]


def make_optimizer(groups: List[dict], t: TrainConfig, **adafactor) -> torch.optim.Optimizer:
    """``--optimizer`` over ``groups`` (``BUILDERS``); ``adafactor``: the pieces and shared pieces
    of its mains (``optim/adafactor.py``), for a factored kind."""
    return BUILDERS[t.optimizer](groups, t, **adafactor)


def lion(groups: List[dict], t: TrainConfig) -> Lion:
    return Lion(groups, lr=t.lr, betas=(t.lion_beta1, t.lion_beta2), moment_dtype=moment_dtypes(t)["exp_avg"])


def adafactor(groups: List[dict], t: TrainConfig, **pieces) -> Adafactor:
    return Adafactor(
        groups,
        lr=t.lr,
        beta2_decay=t.adafactor_beta2_decay,
        eps=(None, t.adafactor_eps2),
        d=t.adafactor_clip_threshold,
        **pieces,
    )


def adamw(groups: List[dict], t: TrainConfig) -> PrecisionAwareAdamW:
    """AdamW over ``groups``, its moments in their flags' dtypes: on CPU the host kernel on the
    rank's ``--host-optimizer-threads`` (all-fp32 included: bitwise torch's fused kernel), on a
    device torch's fused kernel (``PrecisionAwareAdamW``)."""
    return PrecisionAwareAdamW(groups, moment_dtypes(t), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


# The kernel of each spec of config/optimizers.py, built from the config.
BUILDERS = {"adam": adamw, "lion": lion, "adafactor": adafactor}


class WrappedOptimizer:
    """An optimizer that steps ``inner`` its own way (``step``); its groups (which the LR
    scheduler writes), state and state dicts are ``inner``'s."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> None:
        self.inner.step()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)


class StagedOptimizer(WrappedOptimizer):
    """An optimizer whose state lives on host for weights that stay on the device (ZeRO-Offload
    for the chosen layers).

    A torch optimizer keyed by the (device) main parameters: around ``step`` (and
    ``load_state_dict``, so loaded moments land on host) each main parameter's ``.data`` and
    ``.grad`` are swapped for host copies, the host kernel runs, and the updated values are
    copied back. Per step that moves the main parameters and gradients to host and the
    parameters back; the device copy stays the one the rest of the code reads.
    """

    def _params(self) -> list:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _on_host(self, fn) -> None:
        params = self._params()
        saved = [(p.data, p.grad) for p in params]
        with torch.no_grad():
            try:
                for p, (data, grad) in zip(params, saved, strict=True):
                    p.grad = None
                    p.data = data.to("cpu", copy=True)
                    if grad is not None:
                        p.grad = grad.to("cpu", copy=True)
                fn()
            finally:
                for p, (data, grad) in zip(params, saved, strict=True):
                    host = p.data
                    p.grad = None
                    p.data = data
                    data.copy_(host)
                    p.grad = grad

    def step(self) -> None:
        self._on_host(self.inner.step)

    def load_state_dict(self, sd: dict) -> None:
        self._on_host(lambda: self.inner.load_state_dict(sd))
