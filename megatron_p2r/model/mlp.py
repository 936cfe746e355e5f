"""The dense MLP: column-parallel up-projection, GELU or SwiGLU, row-parallel down-projection."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_p2r.parallel.state import ParallelState


def activation(y: torch.Tensor, swiglu: bool, gelu_approximation: str) -> torch.Tensor:
    """GELU (exact or tanh: ``ModelConfig.gelu_approximation``), or SwiGLU on rows interleaved as
    (gate_j, up_j): a contiguous TP split keeps pairs."""
    if not swiglu:
        return F.gelu(y, approximate=gelu_approximation)
    gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, ffn_size: int | None = None, device=None, *,
                 sequence_parallel: bool = False):
        super().__init__()
        h, ffn = cfg.hidden_size, ffn_size or cfg.ffn_size
        self.swiglu, self.gelu_approximation = cfg.swiglu, cfg.gelu_approximation
        self.fc1 = ColumnParallelLinear(h, ffn * (2 if cfg.swiglu else 1), ps, bias=cfg.add_bias,
                                        init_std=cfg.init_method_std, sequence_parallel=sequence_parallel,
                                        device=device)
        self.fc2 = RowParallelLinear(ffn, h, ps, bias=cfg.add_bias,
                                     init_std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                     sequence_parallel=sequence_parallel, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(x), self.swiglu, self.gelu_approximation))
