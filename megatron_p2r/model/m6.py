"""The M6 language model, one pipeline stage of it.

A stage holds the layers of its global range; the first stage adds the embedding, the last
the final norm, the output layer and the loss. Layers are kept in ``self.layers`` keyed by
the global index of the module they call (see ``p2r.sharing.layer_module_keys``), so module
paths are global names: ``layers.5.attention.qkv.weight`` means the same tensor on every
layout, and in the pseudo phase several layers call one key.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from megatron_p2r.config import Config
from megatron_p2r.model.attention import rotary_tables
from megatron_p2r.model.block import TransformerLayer, make_norm
from megatron_p2r.p2r.sharing import effective_pattern, layer_module_keys, stages_using_slot
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_p2r.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_p2r.parallel.mappings import copy_to_region
from megatron_p2r.parallel.sharding import init_parameters, logical_name
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.partition import stage_layer_ranges

WORD_EMBEDDING = "embedding.word_embeddings.weight"


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


def model_layer_keys(cfg: Config) -> List[int]:
    m = cfg.model
    pattern = effective_pattern(cfg.p2r.p2r_phase, cfg.p2r.share_pattern)
    return layer_module_keys(pattern, m.num_layers, [m.is_moe_layer(i) for i in range(m.num_layers)])


def stage_ranges(cfg: Config) -> List[range]:
    p = cfg.parallel
    return stage_layer_ranges(cfg.model.num_layers, p.pipeline_model_parallel_size, p.pipeline_layer_split)


def replica_stage_sets(cfg: Config) -> Dict[str, tuple]:
    """Tensors held by several pipeline stages -> those stages (their gradients are summed).

    Keys are module-name prefixes: ``layers.K`` for a pseudo-phase module called on several
    stages, and the word embedding when it is tied and the model has more than one stage.
    """
    keys = model_layer_keys(cfg)
    ranges = stage_ranges(cfg)
    out = {f"layers.{k}": tuple(stages) for k, stages in stages_using_slot(keys, ranges).items()
           if len(stages) > 1}
    if not cfg.model.untie_embeddings_and_output_weights and len(ranges) > 1:
        out[WORD_EMBEDDING] = (0, len(ranges) - 1)
    return out


class M6Model(nn.Module):
    """One pipeline stage. ``forward`` takes token ids (first stage) or the previous stage's
    hidden states and returns hidden states, or per-token losses on the last stage."""

    def __init__(self, cfg: Config, ps: ParallelState, device=None):
        super().__init__()
        m = cfg.model
        self.cfg, self.ps = cfg, ps
        self.recompute = cfg.train.recompute_activations
        self.layer_range = stage_ranges(cfg)[ps.pp_rank]
        keys = model_layer_keys(cfg)
        self.layer_keys = [keys[i] for i in self.layer_range]
        self.layers = nn.ModuleDict({str(k): TransformerLayer(m, ps, m.is_moe_layer(k), device)
                                     for k in dict.fromkeys(self.layer_keys)})
        self.embedding = Embedding(cfg, ps, device) if ps.is_first_stage else None
        self.final_norm = make_norm(m, device) if ps.is_last_stage else None
        self.output_layer = None
        tied = not m.untie_embeddings_and_output_weights
        if ps.is_last_stage and not (tied and ps.is_first_stage):
            self.output_layer = ColumnParallelLinear(m.hidden_size, m.padded_vocab_size, ps,
                                                     bias=False, init_std=m.init_method_std, device=device)
            if tied:  # a replica of the first stage's embedding; gradients summed over the embedding group
                self.output_layer.weight.shared_name = WORD_EMBEDDING
        self.rope_base = m.rotary_base if m.position_embedding_type == "rope" else None
        # module key -> callable(position, layer, x, rope) that runs that layer instead of the
        # default call (set by optim.offload for layers whose weights live on host)
        self.layer_runners: Dict[int, Callable] = {}
        self._mark_stage_replicas(replica_stage_sets(cfg))

    def _mark_stage_replicas(self, shared: Dict[str, tuple]) -> None:
        for name, p in self.named_parameters():
            logical = logical_name(name, p)
            for prefix, stages in shared.items():
                if logical == prefix or logical.startswith(prefix + "."):
                    p.shared_stages = stages

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
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embedding(tokens) if self.embedding is not None else hidden
        rope = self._rope(x.shape[1], x.device)
        for position, key in enumerate(self.layer_keys):
            layer = self.layers[str(key)]
            runner = self.layer_runners.get(key)
            if runner is not None:  # e.g. optim.offload: fetch host weights, run, release
                x = runner(position, layer, x, rope)
            elif self.recompute and self.training:
                x = tp_random.checkpoint(layer, x, rope, device=self.ps.device)
            else:
                x = layer(x, rope)
        if self.final_norm is None:
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


def build_model(cfg: Config, ps: ParallelState, *, meta: bool = False) -> M6Model:
    """Build this rank's stage; on ``meta`` nothing is allocated or initialised."""
    device = torch.device("meta") if meta else ps.device
    model = M6Model(cfg, ps, device=device)
    if not meta:
        model.init_weights(cfg.train.seed)
    return model

