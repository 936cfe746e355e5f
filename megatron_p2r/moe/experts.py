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

Rows arrive grouped by local expert with their counts. With ``--moe-grouped-gemm`` (as in
Megatron-LM) they are multiplied as they are, one jagged group per expert, by torch's
``grouped_mm`` where the device and dtype support it (``moe.grouped_mm``): no padded rows, so
FLOPs and saved activations are those of the routed rows whatever the imbalance. Otherwise (the
default) they are scattered into a zero-padded ``[E_local, max_count, h]`` buffer (skipped when
the counts are all equal, e.g. capacity-full experts) and multiplied with ``torch.bmm`` /
``torch.baddbmm``. Neither loops over tokens or experts; both read the same parameters, so a
checkpoint does not depend on the flag. Bias-free SwiGLU experts (Megatron-LM's and Mixtral's)
take ``moe.grouped_swiglu``, one autograd function with a hand-written backward; other
activations and biases compose autograd ops. grouped_mm is not an autocast op: its weights are cast to
the rows' dtype, which is what autocast does for ``bmm``.
"""

from __future__ import annotations

import math
from typing import List

import torch
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.moe.activation import Activation
from megatron_p2r.moe.dispatcher import gather_rows
from megatron_p2r.moe.grouped_mm import expert_weights, grouped_matmul, grouped_mm_runs
from megatron_p2r.moe.grouped_swiglu import grouped_swiglu
from megatron_p2r.parallel.mappings import copy_to_region
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, device=None):
        super().__init__()
        self.num_local = cfg.num_experts // ps.ep_size
        self.activation = Activation(cfg)
        self.grouped_gemm = cfg.moe_grouped_gemm
        self.tp_group, self.tp_size = ps.group("tp"), ps.tp_size
        h, ffn = cfg.hidden_size, cfg.expert_ffn_size // ps.tp_size
        fc1 = ffn * (2 if cfg.gated_linear_unit else 1)
        std = cfg.init_method_std
        self.weight1 = make_param((self.num_local, fc1, h), tp_dim=1, expert=True, init=("normal", std), device=device)
        self.weight2 = make_param(
            (self.num_local, h, ffn),
            tp_dim=2,
            expert=True,
            init=("normal", std / math.sqrt(2 * cfg.num_layers)),
            device=device,
        )
        self.bias1 = self.bias2 = None
        if cfg.add_bias:
            self.bias1 = make_param(
                (self.num_local, fc1), tp_dim=1, expert=True, init=("zeros",), no_wd=True, device=device
            )
            self.bias2 = make_param((self.num_local, h), expert=True, init=("zeros",), no_wd=True, device=device)

    def _activation(self, fc1) -> torch.Tensor:
        """The activation of fc1's output; ``fc1(first, step)`` multiplies by rows first::step of
        weight1: a gated unit's gate and up rows (interleaved) as two matmuls, so the elementwise
        part is contiguous."""
        if self.activation.gated:
            return self.activation.gated_unit(fc1(0, 2), fc1(1, 2))
        return self.activation(fc1(0, 1))

    def _padded(
        self, x: torch.Tensor, counts: List[int], counts_t: torch.Tensor, expert_of_row: torch.Tensor
    ) -> torch.Tensor:
        """Rows padded to the busiest expert's count, batched matmuls, padding rows dropped."""
        E, h, n = self.num_local, x.shape[-1], x.shape[0]
        width = max(counts)
        padded = width * E != n
        if padded:
            starts = torch.cumsum(counts_t, 0) - counts_t
            slot = expert_of_row * width + torch.arange(n, device=x.device) - starts[expert_of_row]
            x = x.new_zeros(E * width, h).index_copy(0, slot, x)
        x = x.view(E, width, h)

        def fc1(first: int, step: int) -> torch.Tensor:
            w = self.weight1[:, first::step].transpose(1, 2)
            if self.bias1 is None:
                return torch.bmm(x, w)
            return torch.baddbmm(self.bias1[:, first::step].unsqueeze(1), x, w)

        y = torch.bmm(self._activation(fc1), self.weight2.transpose(1, 2)).reshape(E * width, h)
        return gather_rows(y, slot) if padded else y

    def _grouped(self, x: torch.Tensor, counts_t: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Each expert's rows, as they are, through grouped_mm."""
        ends = torch.cumsum(counts_t, 0, dtype=torch.int32)
        if self.bias1 is None and self.activation.is_swiglu:
            return grouped_swiglu(x, self.weight1, self.weight2, ends)
        gated = self.activation.gated
        y = grouped_matmul(x, expert_weights(self.weight1, x.dtype, gated), ends)
        if self.bias1 is not None:
            y = y + expert_weights(self.bias1, y.dtype, gated).index_select(0, expert_of_row)
        # gated: y is [gates | ups] per row (expert_weights' order)
        y = self.activation.gated_unit(*y.unflatten(-1, (2, -1)).unbind(-2)) if gated else self.activation(y)
        return grouped_matmul(y, expert_weights(self.weight2, x.dtype), ends)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        return self.grouped_gemm and grouped_mm_runs(
            x.device, x.dtype, x.shape[-1], self.weight2.shape[-1], 2 if self.activation.gated else 1
        )

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """``x`` [N, h] grouped by local expert (``counts`` rows each) -> [N, h] partial over TP."""
        counts_t = torch.tensor(counts, device=x.device)
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local, device=x.device), counts_t, output_size=x.shape[0]
        )
        if self._use_grouped(x):
            y = self._grouped(x, counts_t, expert_of_row)
        else:
            y = self._padded(x, counts, counts_t, expert_of_row)
        if self.bias2 is not None:
            bias2 = copy_to_region(self.bias2, self.tp_group) / self.tp_size
            y = y + bias2.to(y.dtype).index_select(0, expert_of_row)
        return y
