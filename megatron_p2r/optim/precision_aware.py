"""AdamW whose moments are stored below fp32 (``--use-precision-aware-optimizer`` with
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` fp16 or bf16).

Megatron-LM does this inside Transformer Engine's FusedAdam; here it is plain PyTorch, so it
runs on CPU and CUDA, for device, staged and host placements alike. For one main parameter at
a time the stored moments are upcast into fp32 scratch, torch's fused AdamW kernel does the
update (the same arithmetic as fp32 AdamW), and the moments are stored back rounded to nearest
(no stochastic rounding). Scratch holds one parameter's moments, so the saving is 2 bytes per
parameter per 16-bit moment minus the largest main parameter's fp32 moments.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.optim import adamw as torch_adamw

from megatron_p2r.config import TrainConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MOMENTS = ("exp_avg", "exp_avg_sq")


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
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p)
                scratch = {name: state[name].float() for name in MOMENTS}
                torch_adamw.adamw([p], [p.grad], [scratch["exp_avg"]], [scratch["exp_avg_sq"]], [], [state["step"]],
                                  fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                for name in MOMENTS:
                    if scratch[name] is not state[name]:
                        state[name].copy_(scratch[name])
