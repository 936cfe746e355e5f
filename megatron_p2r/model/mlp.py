"""The dense MLP: column-parallel up-projection, GELU or a gated unit, row-parallel down-projection."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe.activation import Activation
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
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
