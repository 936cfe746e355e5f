"""Routers: which experts each token goes to, with what weight, and their auxiliary losses.

Everything here runs in fp32, also under autocast: routing decisions and the softmax are
sensitive to rounding, and the router is a tiny fraction of the FLOPs.

- top-k (``--moe-router-topk``; 1 is Switch, 2 is GShard), Megatron-LM's
  ``--moe-router-score-function``:
  - ``softmax`` (the default): softmax over the E experts, the k largest probabilities are the
    weights with ``--moe-router-pre-softmax``; without it they are rescaled to sum 1
    (Megatron-LM's default: a softmax over the k selected logits is the same);
  - ``sigmoid`` (DeepSeek-V3): each expert's score is sigmoid(logit), independent of the others;
    the k chosen scores are normalised to sum 1 (for k > 1), as Megatron-LM does;
  then the weights are multiplied by ``--moe-router-topk-scaling-factor`` when it is set;
- group-limited top-k (``--moe-router-num-groups G --moe-router-group-topk g``, DeepSeek's
  device/node-limited routing): the E experts form G groups of E/G consecutive experts, each
  group is scored by the sum of its top-(k/g) scores, and the k experts are chosen within the g
  best groups only;
- auxiliary-loss-free balancing (``--moe-router-enable-expert-bias``, with sigmoid): a
  per-expert bias (a buffer, not a parameter) is added to the scores to choose the experts and
  never to their weights; ``moe/expert_bias.py`` updates it after each step;
- expert prototyping (M6-T, ``--moe-num-prototypes K``): the E experts form K groups of E/K,
  each group has its own softmax and each token takes top-1 in every group: K slots per token.

Each token thus has ``slots`` (k, or K) assignments: ``indices [T, slots]`` (global expert ids)
and ``weights [T, slots]``.

Auxiliary losses (``--moe-router-load-balancing-type``, weighted by ``--moe-aux-loss-coeff``), on
the router's probabilities (sigmoid scores normalised over all experts) and each token's
unconstrained top-k (no bias, no group limit), as Megatron-LM computes them:
- ``aux_loss`` (Switch): per softmax group of n experts, ``n * sum_e f_e * P_e`` with f_e the
  fraction of the group's assignments routed to e (before capacity drops) and P_e the mean
  router probability of e; averaged over groups. 1.0 when perfectly balanced.
- ``seq_aux_loss`` (DeepSeek-V2/V3): the same loss taken over each sequence's tokens, averaged
  over the sequences of the micro-batch;
- ``none``: no load-balancing loss;
- z-loss (ST-MoE, ``--moe-z-loss-coeff``): mean over tokens and groups of ``logsumexp(logits)**2``.

Under sequence parallelism each TP rank routes its sequence shard; the losses are taken over
the tokens of all the shards (``sequence_group``): counts and probability sums are all-reduced
(the sums with ``reduce_from_region``, whose identity backward gives each rank's probabilities
their own gradient), so the loss equals the one without sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

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
    probs: torch.Tensor  # [T, groups, E/groups] fp32 router probabilities (sigmoid: the scores)
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


def sequence_load_balancing_loss(
    probs: torch.Tensor, indices: torch.Tensor, batch: int, sequence_group=None
) -> torch.Tensor:
    """Megatron-LM's ``seq_aux_loss``: the Switch loss of each sequence, averaged over the
    ``batch`` sequences. ``probs`` [T, E] (T = batch x s tokens, sequence by sequence: a sequence
    shard each under ``sequence_group``), ``indices`` [T, k] global ids."""
    tokens, n = probs.shape
    k = indices.shape[1]
    per_sequence = indices.view(batch, -1)
    counts = torch.zeros(batch, n, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, per_sequence, torch.ones_like(per_sequence, dtype=probs.dtype))
    prob_sums = probs.view(batch, -1, n).sum(1)  # [batch, E]
    length = tokens // batch
    if sequence_group is not None:
        dist.all_reduce(counts, group=sequence_group)
        prob_sums = reduce_from_region(prob_sums, sequence_group)
        length *= dist.get_world_size(sequence_group)
    # E * sum_e f_e P_e per sequence, f_e = count / (k * length), P_e = prob sum / length
    return (n / (k * length * length) * (prob_sums * counts).sum(-1)).mean()


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top-``topk`` (values, indices) of ``scores`` [T, E] among the experts of each token's
    ``group_topk`` best groups of E/num_groups consecutive experts; a group's score is the sum of
    its top-(topk/group_topk) scores (Megatron-LM's and DeepSeek-V3's statistic)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)  # [T, G]
    chosen = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return masked.topk(topk, dim=-1)


def z_loss(logits: torch.Tensor, sequence_group=None) -> torch.Tensor:
    squares = torch.logsumexp(logits, dim=-1).square()
    if sequence_group is None:
        return squares.mean()
    return reduce_from_region(squares.sum(), sequence_group) / (squares.numel() * dist.get_world_size(sequence_group))


class Router(nn.Module):
    """Linear router ``[E, h]``, replicated on every rank (a non-expert parameter), with a learned
    bias ``[E]`` on its logits when the linear layers have biases (megatron-core's router under
    --add-bias-linear, gpt-oss's: it moves selection and weights alike, unlike the expert bias); with
    ``--moe-router-enable-expert-bias`` also the fp32 buffers ``expert_bias`` [E] (saved in
    checkpoints) and ``tokens_per_expert`` [E] (this step's assignments, counted in backward:
    ``moe/expert_bias.py``)."""

    def __init__(self, cfg: ModelConfig, device=None, *, sequence_group=None):
        super().__init__()
        self.sequence_group = sequence_group
        self.num_experts = cfg.num_experts
        self.groups = cfg.moe_num_prototypes
        self.topk = 1 if self.groups > 1 else cfg.moe_router_topk
        self.renormalize = not cfg.moe_router_pre_softmax
        self.sigmoid = cfg.moe_router_score_function == "sigmoid"
        self.scaling = cfg.moe_router_topk_scaling_factor
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.balancing = cfg.moe_router_load_balancing_type
        self.jitter = cfg.moe_input_jitter_eps
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        if self.balancing == "none":
            self.aux_coeff = 0.0
        self.weight = make_param(
            (cfg.num_experts, cfg.hidden_size), init=("normal", cfg.init_method_std), device=device
        )
        # megatron-core initialises it as the weight (its init_method); no weight decay, as every bias
        self.bias = (
            make_param((cfg.num_experts,), init=("normal", cfg.init_method_std), no_wd=True, device=device)
            if cfg.router_bias
            else None
        )
        enabled = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device) if enabled else None)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, device=device) if enabled else None, persistent=False
        )

    def _apply(self, fn, recurse=True):
        """Moves keep the expert bias and its counts in fp32 (a ``.to(bf16)`` of the model casts
        only the rest): sign updates of 1e-3 would vanish in 16-bit, as Megatron-LM notes."""
        kept = {name: self._buffers[name] for name in ("expert_bias", "tokens_per_expert")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != torch.float32:
                self._buffers[name] = before.to(after.device, torch.float32)
        return self

    @property
    def slots(self) -> int:
        return self.topk * self.groups

    def forward(self, x: torch.Tensor, batch: int = 1) -> Routing:
        """``x`` [T, h] (``batch`` sequences of T/batch tokens) -> Routing (fp32 whatever the
        autocast state)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            if self.training and self.jitter:
                x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits = F.linear(x, self.weight.float(), None if self.bias is None else self.bias.float())
            if self.groups > 1:
                routing, aux_indices = self._prototypes(logits.view(x.shape[0], self.groups, -1)), None
            else:
                routing, aux_indices = self._topk(logits)
            if torch.is_grad_enabled() and (self.aux_coeff or self.z_coeff):
                routing.aux_loss = self._aux_loss(routing, aux_indices, batch)
        return routing

    def _prototypes(self, logits: torch.Tensor) -> Routing:
        """Top-1 of each of the K softmax groups."""
        probs = logits.softmax(dim=-1)
        weights, local = probs.topk(1, dim=-1)  # [T, G, 1]
        offsets = torch.arange(self.groups, device=logits.device).view(1, -1, 1) * (self.num_experts // self.groups)
        return Routing(indices=(local + offsets).flatten(1), weights=weights.flatten(1), probs=probs, logits=logits)

    def _topk(self, logits: torch.Tensor) -> Tuple[Routing, Optional[torch.Tensor]]:
        """The k experts of each token and their weights; also the unconstrained top-k the aux
        losses count (None: the chosen experts are those)."""
        if self.sigmoid:
            probs = torch.sigmoid(logits)  # the scores (the aux losses normalise them over the experts)
            choice = probs if self.expert_bias is None else probs + self.expert_bias  # the bias only selects
            indices = self._select(choice)
            weights = probs.gather(1, indices)
            if self.topk > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            probs = logits.softmax(dim=-1)
            # Megatron-LM limits groups on the logits without --moe-router-pre-softmax (top-k alone
            # is the same on either: softmax is monotonic)
            indices = self._select(logits if self.group_topk and self.renormalize else probs)
            weights = probs.gather(1, indices)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling:
            weights = weights * self.scaling
        constrained = self.group_topk or self.expert_bias is not None
        aux_indices = probs.detach().topk(self.topk, dim=-1).indices if constrained else None
        routing = Routing(indices=indices, weights=weights, probs=probs.unsqueeze(1), logits=logits.unsqueeze(1))
        return routing, aux_indices

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """The chosen experts (a decision: no gradient flows through it, nothing is saved for one)."""
        scores = scores.detach()
        if self.group_topk:
            return group_limited_topk(scores, self.topk, self.num_groups, self.group_topk)[1]
        return scores.topk(self.topk, dim=-1).indices

    def _aux_loss(self, routing: Routing, aux_indices: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        """The coefficient-weighted sum of the load-balancing loss and the z-loss."""
        indices = routing.indices if aux_indices is None else aux_indices
        aux = routing.logits.new_zeros(())
        probs = routing.probs
        if self.sigmoid and self.aux_coeff:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if self.aux_coeff and self.balancing == "seq_aux_loss":
            aux = aux + self.aux_coeff * sequence_load_balancing_loss(
                probs.squeeze(1), indices, batch, self.sequence_group
            )
        elif self.aux_coeff:
            aux = aux + self.aux_coeff * load_balancing_loss(probs, indices, self.sequence_group)
        if self.z_coeff:
            aux = aux + self.z_coeff * z_loss(routing.logits, self.sequence_group)
        return aux
