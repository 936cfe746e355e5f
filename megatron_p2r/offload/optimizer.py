"""The optimizer of a stage with offloaded layers: AdamW on the device for resident parameters
and AdamW on host for offloaded ones, seen as one optimizer.

The host step is issued after the device step so the two overlap on CUDA; the next fetch picks
up the new weights. With ``--cpu-offload-what optimizer`` only the chosen layers' AdamW
moments live on host (``StagedAdamW``: the step runs there on host copies of weights and
gradients).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from megatron_p2r.config import TrainConfig
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.optimizer import build_optimizer, param_groups


class _StateView:
    """optimizer.state keyed by parameter, routed to whichever optimizer owns it."""

    def __init__(self, owners: Dict[int, torch.optim.Optimizer]):
        self.owners = owners

    def __getitem__(self, p):
        return self.owners[id(p)].state[p]

    def get(self, p, default=None):
        owner = self.owners.get(id(p))
        return owner.state[p] if owner is not None and p in owner.state else default

    def __contains__(self, p) -> bool:
        owner = self.owners.get(id(p))
        return owner is not None and p in owner.state


class OffloadedOptimizer:
    """AdamW on the device for resident parameters and AdamW on host for offloaded ones, seen
    as one optimizer: ``param_groups`` (the scheduler sets their lr), ``state[param]``,
    ``state_dict`` / ``load_state_dict`` over all parameters (what checkpoints use)."""

    def __init__(self, device_opt: Optional[torch.optim.Optimizer], host_opt: Optional[torch.optim.Optimizer],
                 manager: OffloadManager):
        self.optimizers = [o for o in (device_opt, host_opt) if o is not None]
        self.device_opt, self.host_opt, self.manager = device_opt, host_opt, manager
        self.state = _StateView({id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]})

    @property
    def param_groups(self) -> list:
        """The sub-optimizers' own group dicts (torch's load_state_dict replaces them)."""
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        if self.device_opt is not None:
            self.device_opt.step()  # queued on the device; it runs while the host step computes
        if self.host_opt is not None:
            self.manager.synchronize()
            self.host_opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """torch's format, parameters numbered in ``param_groups`` order across both optimizers."""
        index, groups = {}, []
        for g in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: s for o in self.optimizers for p, s in o.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        groups, start = sd["param_groups"], 0
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        for o in self.optimizers:
            mine = groups[start:start + len(o.param_groups)]
            start += len(o.param_groups)
            ids = {i for g in mine for i in g["params"]}
            o.load_state_dict({"state": {i: s for i, s in sd["state"].items() if i in ids}, "param_groups": mine})


class StagedAdamW:
    """AdamW whose moments live on host for weights that stay on the device
    (--cpu-offload-what optimizer, ZeRO-Offload for the chosen layers).

    A torch AdamW keyed by the model's own parameters: around ``step`` (and
    ``load_state_dict``, so loaded moments land on host) each parameter's ``.data`` and
    ``.grad`` are swapped for host copies, the host kernel runs, and the updated weights are
    copied back. Per step that moves the weights and gradients to host and the weights back;
    the device weights stay the master copy, so checkpoints and resumes see no difference.
    """

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _params(self) -> list:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _on_host(self, fn) -> None:
        params = self._params()
        saved = [(p.data, p.grad) for p in params]
        with torch.no_grad():
            try:
                for p, (data, grad) in zip(params, saved):
                    p.grad = None
                    p.data = data.to("cpu", copy=True)
                    if grad is not None:
                        p.grad = grad.to("cpu", copy=True)
                fn()
            finally:
                for p, (data, grad) in zip(params, saved):
                    host = p.data
                    p.grad = None
                    p.data = data
                    data.copy_(host)
                    p.grad = grad

    def step(self) -> None:
        self._on_host(self.inner.step)

    def load_state_dict(self, sd: dict) -> None:
        self._on_host(lambda: self.inner.load_state_dict(sd))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def build_split_optimizer(model: nn.Module, t: TrainConfig, manager: OffloadManager) -> OffloadedOptimizer:
    """The usual AdamW groups (weight decay / none), each split into device and offloaded
    parameters; the offloaded ones get a host AdamW (weights on host) or a StagedAdamW."""
    offloaded = manager.offloaded_param_ids
    groups = param_groups(model, t)

    def part(host: bool) -> list:
        out = [{**g, "params": [p for p in g["params"] if (id(p) in offloaded) == host]} for g in groups]
        return [g for g in out if g["params"]]

    device_groups, host_groups = part(False), part(True)
    device_opt = build_optimizer(model, t, params=device_groups) if device_groups else None
    host_opt = build_optimizer(model, t, params=host_groups) if host_groups else None
    if host_opt is not None and "params" not in manager.what:
        host_opt = StagedAdamW(host_opt)
    return OffloadedOptimizer(device_opt, host_opt, manager)
