"""The project's AdamW: torch's arithmetic, its state stored in the flags' dtypes — fp32, or below
(``--use-precision-aware-optimizer`` with ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` fp16 or
bf16, ``--main-params-dtype fp16``), gradients too (``--main-grads-dtype bf16``).

Megatron-LM does this inside Transformer Engine's FusedAdam; here it is plain PyTorch, so it
runs on CPU and CUDA, for device, staged and host placements alike. A main parameter is stepped
in chunks of ``CHUNK`` elements: the chunk's 16-bit main parameter, gradient and moments are
upcast into fp32 scratch, torch's fused AdamW kernel does the update (the same arithmetic,
element by element, as fp32 AdamW), and the parameter and moments are stored back rounded to
nearest (no stochastic rounding). The scratch is small enough to stay in cache. What this buys
is memory (2 bytes per element per 16-bit tensor); all-fp32 weights are stepped by one
multi-tensor call of torch's fused kernel. On CPU every setting, all-fp32 included, runs in one
pass of the host kernel (``optim/host_kernels.py``, bitwise torch's fused kernel) on the rank's
``--host-optimizer-threads`` threads, at the memory bound (``benchmarks/host_optimizer.py``);
torch's kernel is the device's path, and CPU's without a compiler.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch.optim import adamw as torch_adamw

from megatron_p2r.config import TrainConfig
from megatron_p2r.optim import host_kernels
from megatron_p2r.parallel.grad_buffer import DTYPES

MOMENTS = ("exp_avg", "exp_avg_sq")
STEPPED = ("param", "grad") + MOMENTS  # the tensors a step reads; all but the gradient are written
CHUNK = 1 << 18  # elements upcast at a time: their fp32 moments (2 MiB) stay in cache


def moment_dtypes(t: TrainConfig) -> Dict[str, torch.dtype]:
    """The dtype each AdamW moment is stored in (fp32 without --use-precision-aware-optimizer)."""
    return {"exp_avg": DTYPES[t.exp_avg_dtype], "exp_avg_sq": DTYPES[t.exp_avg_sq_dtype]}


class PrecisionAwareAdamW(torch.optim.AdamW):
    """torch's AdamW with each moment kept in ``dtypes[name]``, over main parameters and
    gradients of any float dtype; loading a state dict (whatever dtype its moments have)
    converts them to those dtypes."""

    def __init__(self, groups: list, dtypes: Dict[str, torch.dtype], **kwargs):
        super().__init__(groups, **kwargs)
        self.dtypes = dict(dtypes)
        self._loading: Optional[tuple] = None  # (the state dict being loaded, its moments)
        # first of the load hooks, so that later ones (the NVMe tier's) see the moments
        self.register_load_state_dict_post_hook(PrecisionAwareAdamW._take_moments, prepend=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, but each moment goes straight into its own dtype: torch casts loaded state to
        its parameter's dtype, which would round fp32 moments through an fp16 main's."""
        moments = {i: {n: s[n] for n in MOMENTS if n in s} for i, s in state_dict["state"].items()}
        rest = {i: {k: v for k, v in s.items() if k not in MOMENTS} for i, s in state_dict["state"].items()}
        self._loading = (state_dict, moments)
        try:
            super().load_state_dict({**state_dict, "state": rest})
        finally:
            self._loading = None

    def _take_moments(self) -> None:
        """The loaded moments into the state, each in its dtype (a load hook of torch's)."""
        state_dict, moments = self._loading
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(ids, [p for g in self.param_groups for p in g["params"]], strict=True))
        for i, kept in moments.items():
            for name, value in kept.items():
                self.state[params[i]][name] = value.to(device=params[i].device, dtype=self.dtypes[name])

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            for name in MOMENTS:
                state[name] = torch.zeros_like(p, dtype=self.dtypes[name], memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PrecisionAwareAdamW takes no closure")
        scratch: Dict[torch.device, Dict[str, torch.Tensor]] = {}
        for group in self.param_groups:
            whole = []  # all-fp32 weights off the host kernels: one multi-tensor call of torch's kernel
            for p in group["params"]:
                if p.grad is None:
                    continue
                if host_kernels.steps(p, p.grad) or any(self._lowered(p)):
                    self._step_param(p, group, scratch.setdefault(p.device, {}))
                else:
                    whole.append(p)
            if whole:
                self._step_whole(whole, group)

    def _lowered(self, p: torch.Tensor) -> list:
        """The names of ``p``'s stepped tensors stored below fp32 (``STEPPED``)."""
        dtypes = {"param": p.dtype, "grad": p.grad.dtype, **self.dtypes}
        return [name for name in STEPPED if dtypes[name] != torch.float32]

    def _step_whole(self, params: list, group: dict) -> None:
        """torch's fused AdamW over all-fp32 ``params`` at once (it increments their step counts)."""
        states = [self._state_of(p) for p in params]
        torch_adamw.adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _step_param(self, p: torch.Tensor, group: dict, scratch: Dict[str, torch.Tensor]) -> None:
        """AdamW on ``p`` chunk by chunk: each chunk's 16-bit tensors upcast into ``scratch``
        (fp32, made on first use), stepped, the parameter and moments rounded back. Every chunk
        gets its own copy of the step count (the fused kernel increments the one it is given)."""
        state = self._state_of(p)
        before, beta1, beta2 = state["step"], *group["betas"]
        if host_kernels.steps(p, p.grad):
            host_kernels.adamw(
                p.view(-1),
                p.grad.view(-1),
                state["exp_avg"].view(-1),
                state["exp_avg_sq"].view(-1),
                step=float(before) + 1,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
            state["step"] = before + 1
            return
        flat = {"param": p.view(-1), "grad": p.grad.view(-1), **{name: state[name].view(-1) for name in MOMENTS}}
        lowered = self._lowered(p)
        for name in lowered:
            if name not in scratch:
                scratch[name] = torch.empty(CHUNK, dtype=torch.float32, device=p.device)
        for start in range(0, p.numel(), CHUNK):
            end = min(start + CHUNK, p.numel())
            part = {
                name: scratch[name][: end - start].copy_(flat[name][start:end])
                if name in lowered
                else flat[name][start:end]
                for name in STEPPED
            }
            torch_adamw.adamw(
                [part["param"]],
                [part["grad"]],
                [part["exp_avg"]],
                [part["exp_avg_sq"]],
                [],
                [before.clone()],
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            for name in lowered:
                if name != "grad":
                    flat[name][start:end].copy_(part[name])
        state["step"] = before + 1
