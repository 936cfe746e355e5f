"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers``), on the last stage.

Depth k (1..N) predicts the token k+1 positions ahead: it normalises the previous depth's output
(depth 1: the main model's output after its final norm, as Megatron-LM hands it over) and the
embedding of the input tokens shifted left by k, projects their concatenation
``[embedding, hidden]`` (2h -> h, column-parallel, gathered), runs one transformer layer of the
kind of the model's last layer, its own final norm and the model's shared output head.

Shifts follow Megatron-LM's ``roll_tensor``: shifted left, the positions rolled in are zero (token
id 0, position 0, loss mask 0). The last stage has no input tokens, only the labels (the tokens
shifted by one), which give the same ids. Each depth's loss is its masked token sum, weighted so
that it enters the global token mean (``pipeline/token_loss.py``) as ``scaling_factor / N`` times
that depth's own token mean (Megatron-LM's per-token-loss weighting: x the micro-batch's valid
tokens / the depth's). The model returns the main loss unchanged; the depths' weighted sum rides
on its backward (``attach``), and their values are recorded for the log (``pop_losses``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.model.block import TransformerLayer
from megatron_p2r.model.norm import make_norm
from megatron_p2r.parallel.layers import ColumnParallelLinear
from megatron_p2r.parallel.mappings import scatter_to_sequence_region
from megatron_p2r.parallel.state import ParallelState

_recorded: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (depth, masked loss sum, tokens)


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """``t`` shifted left by one along its last dimension, the position rolled in set to 0."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


class MTPLayer(nn.Module):
    """One prediction depth (Megatron-LM's ``MultiTokenPredictionLayer``)."""

    def __init__(self, m: ModelConfig, ps: ParallelState, device=None, *, sequence_parallel: bool = False):
        super().__init__()
        h, last = m.hidden_size, m.num_layers - 1
        self.enorm = make_norm(m, device)
        self.hnorm = make_norm(m, device)
        self.eh_proj = ColumnParallelLinear(
            2 * h,
            h,
            ps,
            bias=False,
            init_std=m.init_method_std,
            gather_output=True,
            sequence_parallel=sequence_parallel,
            device=device,
        )
        self.layer = TransformerLayer(m, ps, m.is_moe_layer(last), device, sequence_parallel=sequence_parallel)
        self.final_norm = make_norm(m, device)
        self.group = ps.group("tp") if sequence_parallel else None

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope=None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = scatter_to_sequence_region(x, self.group)  # gathered over TP: back to this rank's shard
        return self.final_norm(self.layer(x, rope))


class MultiTokenPrediction(nn.Module):
    """The N depths. ``embed(ids, positions)`` is the model's input embedding (on the last stage:
    a lookup in its replica of the tied table); ``head(x, labels, mask)`` the shared output head
    returning the masked loss sum."""

    def __init__(self, m: ModelConfig, ps: ParallelState, device=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.scaling_factor = m.mtp_loss_scaling_factor
        self.layers = nn.ModuleList(
            MTPLayer(m, ps, device, sequence_parallel=sequence_parallel) for _ in range(m.mtp_num_layers)
        )

    def loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        rope,
        embed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The depths' share of the objective (a scalar to add to the masked sum of the main loss)."""
        ids = labels.clone()  # the tokens shifted left by one, as rolled from the input tokens:
        ids[..., -1] = 0  # the last label is a real token, the rolled-in id is 0
        positions = roll_left(torch.arange(labels.shape[-1], device=labels.device))
        tokens = loss_mask.sum()
        total = hidden.new_zeros((), dtype=torch.float32)
        for depth, layer in enumerate(self.layers, start=1):
            if depth > 1:
                ids, positions = roll_left(ids), roll_left(positions)
            labels, loss_mask = roll_left(labels), roll_left(loss_mask)
            hidden = layer(hidden, embed(ids, positions), rope)
            loss_sum = head(hidden, labels, loss_mask)
            valid = loss_mask.sum()
            if torch.is_grad_enabled():
                _recorded.append((depth, loss_sum.detach().float(), valid.detach().float()))
            weight = self.scaling_factor / len(self.layers) * tokens / valid.clamp(min=1)
            total = total + loss_sum.float() * weight
        return total


class _Attach(torch.autograd.Function):
    """``loss`` unchanged; backward gives ``extra`` the gradient ``loss`` receives."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def attach(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``loss`` (reported as it is) whose backward also runs ``extra``'s, at the same scale."""
    return _Attach.apply(loss, extra.to(loss.dtype))


def pop_losses(num_layers: Optional[int], device: torch.device, groups) -> Optional[List[float]]:
    """Each depth's token-mean loss over the micro-batches recorded since the last pop, summed over
    ``groups`` (pipeline and data-parallel: every rank calls it); None without MTP."""
    global _recorded
    recorded, _recorded = _recorded, []
    if not num_layers:
        return None
    sums = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
    for depth, loss_sum, tokens in recorded:
        sums[depth - 1, 0] += loss_sum.double()
        sums[depth - 1, 1] += tokens.double()
    for group in groups:
        if group is not None:
            dist.all_reduce(sums, group=group)
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()
