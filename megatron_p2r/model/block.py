"""One transformer layer: x + attn(norm(x)), then x + mlp(norm(x)) (dense or MoE); with
--layer-norms output x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2), with both
x + norm(attn(norm(x))) ... (Gemma); each branch times --residual-multiplier when set (Granite).

A MoE layer's forward is its nodes in sequence (``pre``, the experts, ``post``; ``moe/nodes.py``):
the overlapped expert schedule runs the same nodes one graph each (``nodes()``).

Under sequence parallelism ``x`` is this rank's sequence shard: the norms, dropouts and
residual adds run on 1/TP of the tokens, and the residual dropout draws from the
model-parallel RNG stream (``random.dropout_rng``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.model.attention import Attention
from megatron_p2r.model.latent_attention import LatentAttention
from megatron_p2r.model.mlp import MLP, SharedExperts
from megatron_p2r.model.norm import make_norm
from megatron_p2r.moe.layer import MoELayer, Routed
from megatron_p2r.moe.nodes import LayerNodes
from megatron_p2r.context.dropout import sequence_dropout
from megatron_p2r.parallel.random import dropout_rng
from megatron_p2r.parallel.state import ParallelState


def _norm(norm: Optional[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, or ``x`` where --layer-norms puts no norm."""
    return x if norm is None else norm(x)


class TransformerLayer(nn.Module):
    """``recompute_core``: selective recomputation of the attention core (model/attention.py, or
    model/latent_attention.py under --multi-latent-attention);
    ``window``: this layer's sliding window (``ModelConfig.attention_window``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        moe: bool,
        device=None,
        *,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        window: Optional[int] = None,
        cp_comm_type: str = "p2p",
    ):
        super().__init__()
        self.hidden_dropout = cfg.hidden_dropout
        self.residual_multiplier = cfg.residual_multiplier
        self.device, self.sequence_parallel = ps.device, sequence_parallel
        self.context = (ps.cp_size, ps.cp_rank)
        self.input_norm = make_norm(cfg, device) if cfg.input_norms else None
        if cfg.multi_latent_attention:
            self.attention = LatentAttention(
                cfg, ps, device, sequence_parallel=sequence_parallel, recompute_core=recompute_core
            )
        else:
            self.attention = Attention(
                cfg,
                ps,
                device,
                sequence_parallel=sequence_parallel,
                recompute_core=recompute_core,
                window=window,
                cp_comm_type=cp_comm_type,
            )
        self.post_attention_norm = make_norm(cfg, device) if cfg.input_norms else None
        if moe:
            shared = None
            if cfg.shared_expert_ffn_size:
                shared = SharedExperts(cfg, ps, device, sequence_parallel=sequence_parallel)
            self.mlp = MoELayer(cfg, ps, device, sequence_parallel=sequence_parallel, shared_experts=shared)
        else:
            self.mlp = MLP(cfg, ps, device=device, sequence_parallel=sequence_parallel)
        self.attention_output_norm = make_norm(cfg, device) if cfg.output_norms else None
        self.mlp_output_norm = make_norm(cfg, device) if cfg.output_norms else None

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if isinstance(self.mlp, MoELayer):  # its nodes in sequence, the all-to-alls blocking
            residual, routed = self.pre(x, rope)
            return self.post(self.mlp.expert_rows(routed), residual, routed.weights, routed)
        x = self.attend(x, rope)
        return self.add_mlp(x, self.mlp(_norm(self.post_attention_norm, x)))

    def nodes(self) -> Optional[LayerNodes]:
        """This layer cut at its expert all-to-alls (``moe.nodes``); None without any (dense, EP=1)."""
        if not isinstance(self.mlp, MoELayer) or self.mlp.dispatcher.group is None:
            return None
        return LayerNodes(
            pre=self.pre,
            experts=self.mlp.compute,
            post=self.post,
            exchange=self.mlp.exchange,
            group=self.mlp.dispatcher.group,
            shared=self.mlp.shared_experts,
        )

    def pre(self, x: torch.Tensor, rope=None) -> Tuple[torch.Tensor, Routed]:
        """A MoE layer up to its dispatch: attention, router, permute."""
        residual = self.attend(x, rope)
        return residual, self.mlp.route(_norm(self.post_attention_norm, residual))

    def post(self, rows: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor, routed: Routed) -> torch.Tensor:
        """A MoE layer after its combine: unpermute, weight (``weights``: ``routed``'s, or their
        stand-in leaf in a node), add to the residual stream."""
        return self.add_mlp(residual, self.mlp.finish(rows, weights, routed))

    def attend(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """The residual stream after attention (the MLP's input is its norm)."""
        return self._add(x, _norm(self.attention_output_norm, self.attention(_norm(self.input_norm, x), rope)))

    def add_mlp(self, x: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self._add(x, _norm(self.mlp_output_norm, mlp))

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """The residual add of a branch: dropout, then --residual-multiplier (when not 1)."""
        p = self.hidden_dropout if self.training else 0.0
        if self.sequence_parallel:
            with dropout_rng(self.device, p > 0):
                branch = F.dropout(branch, p)
        else:  # under CP the one-process run's masks (context/dropout.py)
            branch = sequence_dropout(branch, p, *self.context)
        if self.residual_multiplier != 1.0:
            branch = branch * self.residual_multiplier
        return x + branch
