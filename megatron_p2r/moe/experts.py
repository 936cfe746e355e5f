"""This rank's experts as stacked weights, applied with batched matmuls.

Parameters (global names ``...experts.weight1`` etc.; ``sharding.expert_key`` names expert
e's slice ``...experts.{e}.weight1``):

    weight1 [E_local, ffn*(2 if gated) / TP, h]    tp_dim 1   (gated: rows interleaved gate/up)
    weight2 [E_local, h, ffn / TP]                 tp_dim 2   (init std / sqrt(2L))
    bias1   [E_local, ffn*(2 if gated) / TP]       tp_dim 1
    bias2   [E_local, h]                           replicated over TP

Experts are TP-sharded like the dense MLP (column-parallel fc1, row-parallel fc2): every TP
rank gets the same tokens and computes its ffn shard, so the output rows are *partial sums*
over TP. The MoE layer reduces them over TP once, after combining the expert outputs per token
(fewer bytes than reducing every routed row). bias2 must then enter that sum exactly once: each
TP rank adds bias2/TP, and bias2 passes ``copy_to_region`` so its gradient is summed over TP.

Rows arrive grouped by local expert with their counts. They are scattered into a zero-padded
``[E_local, max_count, h]`` buffer (skipped when the counts are all equal, e.g. capacity-full
experts) and multiplied with ``torch.bmm`` / ``torch.baddbmm`` — no loop over tokens or experts,
and autocast applies as to any matmul.
"""
from __future__ import annotations

import math
from typing import List

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe.activation import Activation
from megatron_p2r.moe.dispatcher import gather_rows
from megatron_p2r.parallel.mappings import copy_to_region
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None):
        super().__init__()
        self.num_local = cfg.num_experts // ps.ep_size
        self.activation = Activation(cfg)
        self.tp_group, self.tp_size = ps.group("tp"), ps.tp_size
        h, ffn = cfg.hidden_size, cfg.expert_ffn_size // ps.tp_size
        fc1 = ffn * (2 if cfg.gated_linear_unit else 1)
        std = cfg.init_method_std
        self.weight1 = make_param((self.num_local, fc1, h), tp_dim=1, expert=True, init=("normal", std),
                                  device=device)
        self.weight2 = make_param((self.num_local, h, ffn), tp_dim=2, expert=True,
                                  init=("normal", std / math.sqrt(2 * cfg.num_layers)), device=device)
        self.bias1 = self.bias2 = None
        if cfg.add_bias:
            self.bias1 = make_param((self.num_local, fc1), tp_dim=1, expert=True, init=("zeros",), no_wd=True,
                                    device=device)
            self.bias2 = make_param((self.num_local, h), expert=True, init=("zeros",), no_wd=True, device=device)

    def _fc1(self, x: torch.Tensor, first: int, step: int) -> torch.Tensor:
        """x @ rows first::step of weight1 (+ bias1): all rows, or SwiGLU's gate or up rows."""
        w = self.weight1[:, first::step].transpose(1, 2)
        if self.bias1 is None:
            return torch.bmm(x, w)
        return torch.baddbmm(self.bias1[:, first::step].unsqueeze(1), x, w)

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """``x`` [N, h] grouped by local expert (``counts`` rows each) -> [N, h] partial over TP."""
        E, h, n = self.num_local, x.shape[-1], x.shape[0]
        width = max(counts)
        counts_t = torch.tensor(counts, device=x.device)
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x.device), counts_t, output_size=n)
        padded = width * E != n
        if padded:
            starts = torch.cumsum(counts_t, 0) - counts_t
            slot = expert_of_row * width + torch.arange(n, device=x.device) - starts[expert_of_row]
            x = x.new_zeros(E * width, h).index_copy(0, slot, x)
        x = x.view(E, width, h)
        if self.activation.gated:  # gate and up rows (interleaved) as two matmuls: the elementwise part is contiguous
            y = self.activation.gated_unit(self._fc1(x, 0, 2), self._fc1(x, 1, 2))
        else:
            y = self.activation(self._fc1(x, 0, 1))
        y = torch.bmm(y, self.weight2.transpose(1, 2)).reshape(E * width, h)
        if padded:
            y = gather_rows(y, slot)
        if self.bias2 is not None:
            bias2 = copy_to_region(self.bias2, self.tp_group) / self.tp_size
            y = y + bias2.to(y.dtype).index_select(0, expert_of_row)
        return y
