"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one moment per
element instead of AdamW's two, so 4 bytes of state per stepped element (2 with a 16-bit
``--exp-avg-dtype``).

    update = sign(beta1 * m + (1 - beta1) * g)
    w      = w * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

Every operation is element by element, so a flat range of a parameter (the distributed
optimizer's shard) steps exactly as the same elements of the whole parameter would. The moment
is ``exp_avg`` (AdamW's name for the same kind of average), so checkpoints share that entry
with AdamW's first moment. On CPU a step is one pass of the host kernel
(``optim/host_kernels.py``), the same arithmetic.
"""

from __future__ import annotations

import torch

from megatron_p2r.optim import host_kernels


class Lion(torch.optim.Optimizer):
    """Lion over ``groups``; the moment is stored in ``moment_dtype`` (upcast to fp32 for the
    arithmetic, rounded to nearest when stored back)."""

    def __init__(
        self,
        groups: list,
        lr: float,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        moment_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(groups, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.moment_dtype = moment_dtype
        self.register_load_state_dict_post_hook(Lion._store_loaded)

    @staticmethod
    def _store_loaded(optimizer: "Lion") -> None:
        """A loaded moment (fp32 in checkpoints) is kept in this optimizer's dtype."""
        for state in optimizer.state.values():
            if "exp_avg" in state:
                state["exp_avg"] = state["exp_avg"].to(optimizer.moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Lion takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                stored = state["exp_avg"]
                if host_kernels.steps(p, p.grad):
                    host_kernels.lion(
                        p.view(-1),
                        p.grad.view(-1),
                        stored.view(-1),
                        lr=group["lr"],
                        beta1=beta1,
                        beta2=beta2,
                        weight_decay=group["weight_decay"],
                    )
                    state["step"] += 1
                    continue
                moment = stored if stored.dtype == torch.float32 else stored.float()
                grad = p.grad.float()  # a bf16 main gradient (--main-grads-dtype bf16) upcast
                update = torch.lerp(moment, grad, 1 - beta1).sign_()
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                moment.lerp_(grad, 1 - beta2)
                if moment is not stored:
                    stored.copy_(moment)
                state["step"] += 1
