"""AdamW whose moments are stored below fp32 (``--use-precision-aware-optimizer`` with
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` fp16 or bf16).

Megatron-LM does this inside Transformer Engine's FusedAdam; here it is plain PyTorch, so it
runs on CPU and CUDA, for device, staged and host placements alike. A main parameter is stepped
in chunks of ``CHUNK`` elements: the chunk's stored moments are upcast into fp32 scratch, torch's
fused AdamW kernel does the update (the same arithmetic, element by element, as fp32 AdamW), and
the moments are stored back rounded to nearest (no stochastic rounding). The scratch is small
enough to stay in cache. What this buys is memory (2 bytes per element per 16-bit moment); the
conversions cost time: on CPU a step with two bf16 moments takes about twice the fp32 one
(``benchmarks/precision_aware_step.py``).
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.optim import adamw as torch_adamw

from megatron_p2r.config import TrainConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MOMENTS = ("exp_avg", "exp_avg_sq")
CHUNK = 1 << 18   # elements upcast at a time: their fp32 moments (2 MiB) stay in cache


def moment_dtypes(t: TrainConfig) -> Dict[str, torch.dtype]:
    """The dtype each AdamW moment is stored in (fp32 without --use-precision-aware-optimizer)."""
    return {"exp_avg": DTYPES[t.exp_avg_dtype], "exp_avg_sq": DTYPES[t.exp_avg_sq_dtype]}


class PrecisionAwareAdamW(torch.optim.AdamW):
    """torch's AdamW with each moment kept in ``dtypes[name]``; loading a state dict (whatever
    dtype its moments have) converts them to those dtypes."""

    def __init__(self, groups: list, dtypes: Dict[str, torch.dtype], **kwargs):
        super().__init__(groups, **kwargs)
        self.dtypes = dict(dtypes)
        self.register_load_state_dict_post_hook(PrecisionAwareAdamW._store_loaded)

    @staticmethod
    def _store_loaded(optimizer: "PrecisionAwareAdamW") -> None:
        for state in optimizer.state.values():
            for name in MOMENTS:
                if name in state:
                    state[name] = state[name].to(optimizer.dtypes[name])

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
            for p in group["params"]:
                if p.grad is not None:
                    if p.device not in scratch:
                        scratch[p.device] = {name: torch.empty(CHUNK, dtype=torch.float32, device=p.device)
                                             for name in MOMENTS if self.dtypes[name] != torch.float32}
                    self._step_param(p, group, scratch[p.device])

    def _step_param(self, p: torch.Tensor, group: dict, scratch: Dict[str, torch.Tensor]) -> None:
        """AdamW on ``p`` chunk by chunk: each chunk's 16-bit moments upcast into ``scratch``,
        stepped, rounded back. Every chunk gets its own copy of the step count (the fused kernel
        increments the one it is given)."""
        state = self._state_of(p)
        before, beta1, beta2 = state["step"], *group["betas"]
        flat = {"param": p.view(-1), "grad": p.grad.view(-1), **{name: state[name].view(-1) for name in MOMENTS}}
        for start in range(0, p.numel(), CHUNK):
            end = min(start + CHUNK, p.numel())
            moments = {name: scratch[name][:end - start].copy_(flat[name][start:end]) if name in scratch
                       else flat[name][start:end] for name in MOMENTS}
            torch_adamw.adamw([flat["param"][start:end]], [flat["grad"][start:end]], [moments["exp_avg"]],
                              [moments["exp_avg_sq"]], [], [before.clone()], fused=True, amsgrad=False, beta1=beta1,
                              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                              maximize=False)
            for name in scratch:
                flat[name][start:end].copy_(moments[name])
        state["step"] = before + 1
