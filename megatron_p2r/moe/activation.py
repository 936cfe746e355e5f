"""The MLP's activation, shared by the dense MLP (model/mlp.py) and the experts (moe/experts.py);
it lives here because ``model`` sits above ``moe``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_p2r.config import ModelConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's sigmoid approximation (gpt-oss's gate)."""
    return x * torch.sigmoid(1.702 * x)


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (Gemma's gate, transformers' gelu_pytorch_tanh)."""
    return F.gelu(x, approximate="tanh")


class Activation:
    """fc1's output -> fc2's input: GELU (exact or tanh: ``ModelConfig.gelu_approximation``), or a
    gated unit act(gate) * (up + --glu-linear-offset) with SiLU (SwiGLU), tanh GELU (--geglu) or
    quick-GELU (--quick-geglu), gate and up clamped first under --activation-func-clamp-value (Megatron-LM's
    unfused ``glu``, as gpt-oss in transformers)."""

    def __init__(self, cfg: ModelConfig):
        self.gated, self.gelu_approximation = cfg.gated_linear_unit, cfg.gelu_approximation
        self.gate_function = quick_gelu if cfg.quick_geglu else tanh_gelu if cfg.geglu else F.silu
        self.offset, self.clamp = cfg.glu_linear_offset, cfg.activation_func_clamp_value

    @property
    def is_swiglu(self) -> bool:
        """SiLU-gated with neither clamp nor offset: what ``moe.grouped_swiglu`` computes."""
        return self.gated and self.gate_function is F.silu and self.clamp is None and not self.offset

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """``y``: rows interleaved as (gate_j, up_j) when gated, so a contiguous TP split keeps pairs."""
        if not self.gated:
            return F.gelu(y, approximate=self.gelu_approximation)
        gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
        return self.gated_unit(gate, up)

    def gated_unit(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
        if self.offset:
            up = up + self.offset
        return self.gate_function(gate) * up
