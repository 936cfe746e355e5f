"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)) (dense or MoE).

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
from megatron_p2r.model.mlp import MLP
from megatron_p2r.model.norm import make_norm
from megatron_p2r.moe.layer import MoELayer, Routed
from megatron_p2r.moe.nodes import LayerNodes
from megatron_p2r.parallel.random import dropout_rng
from megatron_p2r.parallel.state import ParallelState


class TransformerLayer(nn.Module):
    """``recompute_core``: selective recomputation of the attention core (model/attention.py);
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
        self.device, self.sequence_parallel = ps.device, sequence_parallel
        self.input_norm = make_norm(cfg, device)
        self.attention = Attention(
            cfg,
            ps,
            device,
            sequence_parallel=sequence_parallel,
            recompute_core=recompute_core,
            window=window,
            cp_comm_type=cp_comm_type,
        )
        self.post_attention_norm = make_norm(cfg, device)
        if moe:
            self.mlp = MoELayer(cfg, ps, device, sequence_parallel=sequence_parallel)
        else:
            self.mlp = MLP(cfg, ps, device=device, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if isinstance(self.mlp, MoELayer):  # its nodes in sequence, the all-to-alls blocking
            residual, routed = self.pre(x, rope)
            return self.post(self.mlp.expert_rows(routed), residual, routed.weights, routed)
        x = self.attend(x, rope)
        return self.add_mlp(x, self.mlp(self.post_attention_norm(x)))

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
        )

    def pre(self, x: torch.Tensor, rope=None) -> Tuple[torch.Tensor, Routed]:
        """A MoE layer up to its dispatch: attention, router, permute."""
        residual = self.attend(x, rope)
        return residual, self.mlp.route(self.post_attention_norm(residual))

    def post(self, rows: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor, routed: Routed) -> torch.Tensor:
        """A MoE layer after its combine: unpermute, weight (``weights``: ``routed``'s, or their
        stand-in leaf in a node), add to the residual stream."""
        return self.add_mlp(residual, self.mlp.finish(rows, weights, routed))

    def attend(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """The residual stream after attention (the MLP's input is its norm)."""
        p = self.hidden_dropout if self.training else 0.0
        attention = self.attention(self.input_norm(x), rope)
        with dropout_rng(self.device, self.sequence_parallel and p > 0):
            return x + F.dropout(attention, p)

    def add_mlp(self, x: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        with dropout_rng(self.device, self.sequence_parallel and p > 0):
            return x + F.dropout(mlp, p)
