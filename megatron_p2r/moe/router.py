"""Routers: which experts each token goes to, with what weight, and their auxiliary losses.

Everything here runs in fp32, also under autocast: routing decisions and the softmax are
sensitive to rounding, and the router is a tiny fraction of the FLOPs.

- top-k (``--moe-router-topk``; 1 is Switch, 2 is GShard): softmax over the E experts, the k
  largest probabilities are the weights with ``--moe-router-pre-softmax``; without it they are
  rescaled to sum 1 (Megatron-LM's default: a softmax over the k selected logits is the same);
- expert prototyping (M6-T, ``--moe-num-prototypes K``): the E experts form K groups of E/K,
  each group has its own softmax and each token takes top-1 in every group: K slots per token.

Each token thus has ``slots`` (k, or K) assignments: ``indices [T, slots]`` (global expert ids)
and ``weights [T, slots]``. Both kinds are the same computation on ``groups`` softmax groups
(1 group with top-k, or K groups with top-1), which is how the code treats them.

Auxiliary losses, on the groups:
- load balancing (Switch): per group of n experts, ``n * sum_e f_e * P_e`` with f_e the
  fraction of the group's assignments routed to e (before capacity drops) and P_e the mean
  router probability of e; averaged over groups. 1.0 when perfectly balanced.
- z-loss (ST-MoE): mean over tokens and groups of ``logsumexp(logits)**2``.

Under sequence parallelism each TP rank routes its sequence shard; both losses are taken over
the tokens of all the shards (``sequence_group``): counts and probability sums are all-reduced
(the sums with ``reduce_from_region``, whose identity backward gives each rank's probabilities
their own gradient), so the loss equals the one without sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.parallel.mappings import reduce_from_region
from megatron_p2r.parallel.sharding import make_param


@dataclass
class Routing:
    indices: torch.Tensor  # [T, slots] int64 global expert ids
    weights: torch.Tensor  # [T, slots] fp32 combine weights
    probs: torch.Tensor  # [T, groups, E/groups] fp32 router probabilities
    logits: torch.Tensor  # [T, groups, E/groups] fp32
    aux_loss: Optional[torch.Tensor] = None  # coefficient-weighted sum of both losses


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, sequence_group=None) -> torch.Tensor:
    """Switch loss averaged over groups; ``probs`` [T, G, n], ``indices`` [T, slots] global ids
    (of this rank's tokens: a sequence shard when ``sequence_group`` is set)."""
    tokens, groups, n = probs.shape
    counts = torch.bincount(indices.reshape(-1), minlength=groups * n).view(groups, n).to(probs.dtype)
    if sequence_group is None:
        mean_prob = probs.mean(0)  # P_e, [G, n]
    else:
        dist.all_reduce(counts, group=sequence_group)
        mean_prob = reduce_from_region(probs.sum(0), sequence_group) / (tokens * dist.get_world_size(sequence_group))
    fraction = counts / counts.sum(-1, keepdim=True)  # f_e per group
    return (n * (fraction * mean_prob).sum(-1)).mean()


def z_loss(logits: torch.Tensor, sequence_group=None) -> torch.Tensor:
    squares = torch.logsumexp(logits, dim=-1).square()
    if sequence_group is None:
        return squares.mean()
    return reduce_from_region(squares.sum(), sequence_group) / (squares.numel() * dist.get_world_size(sequence_group))


class Router(nn.Module):
    """Linear router ``[E, h]``, replicated on every rank (a non-expert parameter)."""

    def __init__(self, cfg: ModelConfig, device=None, *, sequence_group=None):
        super().__init__()
        self.sequence_group = sequence_group
        self.num_experts = cfg.num_experts
        self.groups = cfg.moe_num_prototypes
        self.topk = 1 if self.groups > 1 else cfg.moe_router_topk
        self.renormalize = not cfg.moe_router_pre_softmax
        self.jitter = cfg.moe_input_jitter_eps
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.weight = make_param(
            (cfg.num_experts, cfg.hidden_size), init=("normal", cfg.init_method_std), device=device
        )

    @property
    def slots(self) -> int:
        return self.topk * self.groups

    def forward(self, x: torch.Tensor) -> Routing:
        """``x`` [T, h] -> Routing (fp32 whatever the autocast state)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            if self.training and self.jitter:
                x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits = F.linear(x, self.weight.float()).view(x.shape[0], self.groups, -1)
            probs = logits.softmax(dim=-1)
            weights, local = probs.topk(self.topk, dim=-1)  # [T, G, k]
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            per_group = self.num_experts // self.groups
            offsets = torch.arange(self.groups, device=x.device).view(1, -1, 1) * per_group
            indices = (local + offsets).flatten(1)
            routing = Routing(indices=indices, weights=weights.flatten(1), probs=probs, logits=logits)
            if torch.is_grad_enabled() and (self.aux_coeff or self.z_coeff):
                aux = logits.new_zeros(())
                if self.aux_coeff:
                    aux = aux + self.aux_coeff * load_balancing_loss(probs, indices, self.sequence_group)
                if self.z_coeff:
                    aux = aux + self.z_coeff * z_loss(logits, self.sequence_group)
                routing.aux_loss = aux
        return routing
