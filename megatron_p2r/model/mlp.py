"""The dense MLP: column-parallel up-projection, GELU or a gated unit, row-parallel down-projection;
the same MLP as a MoE layer's shared experts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe.activation import Activation
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        ffn_size: int | None = None,
        device=None,
        *,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        h, ffn = cfg.hidden_size, ffn_size or cfg.ffn_size
        self.activation = Activation(cfg)
        self.fc1 = ColumnParallelLinear(
            h,
            ffn * (2 if cfg.gated_linear_unit else 1),
            ps,
            bias=cfg.add_bias,
            init_std=cfg.init_method_std,
            sequence_parallel=sequence_parallel,
            device=device,
        )
        self.fc2 = RowParallelLinear(
            ffn,
            h,
            ps,
            bias=cfg.add_bias,
            init_std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
            sequence_parallel=sequence_parallel,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class SharedExperts(MLP):
    """DeepSeek's shared experts (``--moe-shared-expert-intermediate-size``): a dense MLP of their
    own FFN size beside a MoE layer's routed experts, on every token, TP-split like the dense MLP
    (its own reductions), never through the dispatcher. With ``--moe-shared-expert-gate`` the
    output is scaled by ``sigmoid(gate_weight . x)`` per token (``gate_weight`` [1, h], replicated;
    under sequence parallelism each TP rank applies it to its shard: a partial gradient). Built
    here and run by ``moe.layer.MoELayer``."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None, *, sequence_parallel: bool = False):
        super().__init__(cfg, ps, cfg.shared_expert_ffn_size, device, sequence_parallel=sequence_parallel)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            self.gate_weight = make_param((1, cfg.hidden_size), init=("normal", cfg.init_method_std), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.gate_weight.to(x.dtype)))
