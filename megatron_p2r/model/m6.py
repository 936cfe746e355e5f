"""The M6 language model, one pipeline stage of it.

A stage holds the layers of its model chunks (from the ``ParallelPlan``: one chunk, or v with
interleaving, each a virtual stage with a global layer range); the first chunk of the first
stage adds the embedding, the last chunk of the last stage the final norm, the output layer
and the loss. ``forward(..., chunk=c)`` runs chunk c. Layers are kept in
``self.layers`` keyed by the global index of the module they call (``layout.sharing``), so
module paths are global names: ``layers.5.attention.qkv.weight`` means the same tensor on
every layout, and in the pseudo phase several layers call one key — also across the chunks of
a stage, which then share one module and accumulate its gradient locally.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.tensors import WORD_EMBEDDING
from megatron_p2r.model.attention import rotary_tables
from megatron_p2r.model.block import TransformerLayer, make_norm
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_p2r.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_p2r.parallel.mappings import copy_to_region
from megatron_p2r.parallel.sharding import init_parameters
from megatron_p2r.parallel.state import ParallelState


class Embedding(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState, device=None):
        super().__init__()
        m = cfg.model
        self.word_embeddings = VocabParallelEmbedding(m.padded_vocab_size, m.hidden_size, ps,
                                                      init_std=m.init_method_std, device=device)
        self.position_embeddings = None
        if m.position_embedding_type == "learned_absolute":
            # _weight skips nn.Embedding's own normal_ init (init_parameters draws it; on the meta
            # device that init would import torch._dynamo, seconds per process)
            self.position_embeddings = nn.Embedding(m.max_positions, m.hidden_size,
                                                    _weight=torch.empty(m.max_positions, m.hidden_size, device=device))
            p = self.position_embeddings.weight
            p.tp_dim, p.expert, p.no_wd, p.init = None, False, False, ("normal", m.init_method_std)
        self.dropout = m.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return nn.functional.dropout(x, self.dropout if self.training else 0.0)


class M6Model(nn.Module):
    """One pipeline stage. ``forward`` takes token ids (first virtual stage) or the previous
    virtual stage's hidden states and returns hidden states, or per-token losses on the last.

    ``layer_calls[i]`` runs the stage's i-th layer (chunk by chunk): the layer module itself, wrapped for
    activation recomputation when asked; ``offload.apply_offload`` replaces the entries of
    offloaded layers with calls that fetch their weights from host.
    """

    def __init__(self, cfg: Config, ps: ParallelState, plan: ParallelPlan, device=None):
        super().__init__()
        m = cfg.model
        self.cfg, self.ps = cfg, ps
        self.stage = stage = plan.stage(ps.pp_rank)
        self.layer_keys = list(stage.layer_keys)
        self.num_model_chunks = len(stage.chunks)
        starts = [0]
        for chunk in stage.chunks:
            starts.append(starts[-1] + len(chunk.layer_keys))
        self._chunk_calls = [range(a, b) for a, b in zip(starts, starts[1:])]   # positions in layer_calls
        self.layers = nn.ModuleDict({str(k): TransformerLayer(m, ps, m.is_moe_layer(k), device)
                                     for k in stage.modules})
        self.embedding = Embedding(cfg, ps, device) if stage.first else None
        self.final_norm = make_norm(m, device) if stage.last else None
        self.output_layer = None
        tied = not m.untie_embeddings_and_output_weights
        if stage.last and not (tied and stage.first):
            self.output_layer = ColumnParallelLinear(m.hidden_size, m.padded_vocab_size, ps,
                                                     bias=False, init_std=m.init_method_std, device=device)
            if tied:  # a replica of the first stage's embedding; gradients summed over the embedding group
                self.output_layer.weight.shared_name = WORD_EMBEDDING
        self.rope_base = m.rotary_base if m.position_embedding_type == "rope" else None
        layers = [self.layers[str(k)] for k in self.layer_keys]
        if cfg.train.recompute_activations:
            layers = [functools.partial(_recomputed, layer, ps.device) for layer in layers]
        self.layer_calls: List[Callable] = layers

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.ps.tp_rank, self.ps.tp_size, self.ps.ep_rank)

    def _rope(self, seq_len: int, device) -> Optional[tuple]:
        if self.rope_base is None:
            return None
        return rotary_tables(seq_len, self.cfg.model.head_dim, self.rope_base, device)

    def hidden_spec(self, tokens_shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the hidden states between stages for a micro-batch of
        ``tokens_shape``: the pipeline receiver allocates this instead of receiving a header.
        The residual stream keeps the parameters' dtype (autocast computes inside the layers)."""
        return (*tokens_shape, self.cfg.model.hidden_size), next(self.parameters()).dtype

    def forward(self, tokens: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, chunk: int = 0) -> torch.Tensor:
        spec = self.stage.chunks[chunk]
        x = self.embedding(tokens) if spec.first else hidden
        rope = self._rope(x.shape[1], x.device)
        for position in self._chunk_calls[chunk]:
            x = self.layer_calls[position](x, rope)
        if not spec.last:
            return x
        x = self.final_norm(x)
        if self.output_layer is not None:
            logits = self.output_layer(x)
        else:  # tied weights on a single stage: project through the input embedding
            logits = nn.functional.linear(copy_to_region(x, self.ps.group("tp")),
                                          self.embedding.word_embeddings.weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ps.group("tp"))


def _recomputed(layer: nn.Module, device: torch.device, x: torch.Tensor, rope) -> torch.Tensor:
    """``layer(x, rope)``, its activations recomputed in backward when gradients are on."""
    if not torch.is_grad_enabled():
        return layer(x, rope)
    return tp_random.checkpoint(layer, x, rope, device=device)


def build_model(cfg: Config, ps: ParallelState, plan: Optional[ParallelPlan] = None, *,
                meta: bool = False, device: Optional[torch.device] = None) -> M6Model:
    """Build this rank's stage of ``plan`` (default: the plan of ``cfg`` on ``ps.layout``) on
    ``device`` (default ``ps.device``); on ``meta`` nothing is allocated or initialised."""
    plan = plan or ParallelPlan.build(cfg, ps.layout)
    device = torch.device("meta") if meta else (device or ps.device)
    model = M6Model(cfg, ps, plan, device=device)
    if not meta:
        model.init_weights(cfg.train.seed)
    return model

