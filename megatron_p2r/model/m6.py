"""The M6 language model, one pipeline stage of it.

A stage holds the layers of its model chunks (from the ``ParallelPlan``: one chunk, or v with
interleaving, each a virtual stage with a global layer range); the first chunk of the first
stage adds the embedding, the last chunk of the last stage the final norm, the output layer,
the loss and the multi-token prediction depths (``model/mtp.py``). ``forward(..., chunk=c)``
runs chunk c. Layers are kept in ``self.layers`` keyed by the global index of the module they
call (``layout.sharing``), so module paths are global names: ``layers.5.attention.qkv.weight``
means the same tensor on every layout, and in the pseudo phase several layers call one key —
also across the chunks of a stage, which then share one module and accumulate its gradient
locally.

Sequence parallelism (``plan.sequence_parallel``): the embedding reduce-scatters into this
rank's sequence shard ``[b, s/TP, h]``, the layers and the final norm run on the shard,
stages exchange the shard, and the output layer gathers the sequence again.

Context parallelism (``ps.cp_size`` > 1): tokens are this CP rank's two chunks of each sequence
(``context.chunks``); learned and rotary positions are the chunks' true positions, attention
talks across the CP group (model/attention.py), every other module runs on the chunks unchanged.

Recomputation (Megatron-LM's flags): ``selective`` recomputes each layer's attention core
(``Attention.core``); ``full`` recomputes units of layers of each model chunk
(``TrainConfig.recompute_units``: uniform chunks of N layers, or the first N layers of the
chunk, as Megatron-LM applies them to each virtual stage's block). Offloaded layers recompute
themselves and stay outside the units.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from megatron_p2r.config import Config
from megatron_p2r.context.chunks import chunk_positions
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING, holds_embedding_replica
from megatron_p2r.model.attention import model_rotary_tables
from megatron_p2r.model.latent_attention import latent_rotary_tables
from megatron_p2r.model.block import TransformerLayer
from megatron_p2r.model.mtp import MultiTokenPrediction, attach
from megatron_p2r.model.norm import make_norm
from megatron_p2r.moe.nodes import LayerNodes
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.cross_entropy import output_cross_entropy, soft_capped
from megatron_p2r.parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    vocab_parallel_lookup,
)
from megatron_p2r.parallel.mappings import reduce_from_region, reduce_scatter_to_sequence_region
from megatron_p2r.context.dropout import sequence_dropout
from megatron_p2r.parallel.random import dropout_rng
from megatron_p2r.parallel.sharding import init_parameters
from megatron_p2r.parallel.state import ParallelState


class Embedding(nn.Module):
    """Word embeddings (times --embedding-multiplier) (+ learned positions) and dropout; under sequence parallelism the output is
    this rank's sequence shard, its positions those of the shard."""

    def __init__(self, cfg: Config, ps: ParallelState, device=None, *, sequence_parallel: bool = False):
        super().__init__()
        m = cfg.model
        self.word_embeddings = VocabParallelEmbedding(
            m.padded_vocab_size,
            m.hidden_size,
            ps,
            init_std=m.init_method_std,
            sequence_parallel=sequence_parallel,
            device=device,
        )
        self.sequence_parallel, self.tp_rank, self.device = sequence_parallel, ps.tp_rank, ps.device
        self.ps = ps
        self.position_embeddings = None
        if m.position_embedding_type == "learned_absolute":
            # _weight skips nn.Embedding's own normal_ init (init_parameters draws it; on the meta
            # device that init would import torch._dynamo, seconds per process)
            self.position_embeddings = nn.Embedding(
                m.max_positions, m.hidden_size, _weight=torch.empty(m.max_positions, m.hidden_size, device=device)
            )
            p = self.position_embeddings.weight
            p.tp_dim, p.expert, p.no_wd, p.init = None, False, False, ("normal", m.init_method_std)
        self.dropout = m.hidden_dropout
        self.multiplier = m.embedding_multiplier

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``positions``: of every token of the sequence (default 0, 1, ...)."""
        x = self.word_embeddings(tokens)
        if self.multiplier != 1.0:
            x = x * self.multiplier
        if self.position_embeddings is not None:
            if positions is None:  # this rank's tokens' places in the sequence (its chunks under CP)
                positions = sequence_positions(self.ps, tokens.shape[1], tokens.device)
            start = self.tp_rank * x.shape[1] if self.sequence_parallel else 0
            x = x + self.position_embeddings(positions[start : start + x.shape[1]])
        return embedding_dropout(x, self.dropout if self.training else 0.0, self.ps, self.sequence_parallel)


def embedding_dropout(x: torch.Tensor, p: float, ps: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """The embedding's dropout; on sequence shards from the model-parallel RNG stream, else under
    CP with the one-process run's masks (context/dropout.py)."""
    if not sequence_parallel:
        return sequence_dropout(x, p, ps.cp_size, ps.cp_rank)
    with dropout_rng(ps.device, p > 0):
        return nn.functional.dropout(x, p)


def sequence_positions(ps: ParallelState, seq_len: int, device) -> torch.Tensor:
    """The positions in the whole sequence of this rank's ``seq_len`` tokens: 0..seq_len-1, or
    under context parallelism its two chunks' (``context.chunks``)."""
    if ps.cp_size == 1:
        return torch.arange(seq_len, device=device)
    return chunk_positions(seq_len * ps.cp_size, ps.cp_size, ps.cp_rank, device)


def logits_or_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: Optional[torch.Tensor],
    loss_mask: Optional[torch.Tensor],
    group,
    sequence_parallel: bool,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Logits ``[b, s, V/TP]``, or with ``labels`` the loss fused with the output layer; the
    logits soft-capped at ``softcap`` (--final-logit-softcapping) when given."""
    if labels is None:
        return soft_capped(column_parallel_linear(x, weight, None, group, sequence_parallel), softcap)[0]
    return output_cross_entropy(x, weight, labels, group, sequence_parallel, loss_mask, softcap)


class OutputLayer(ColumnParallelLinear):
    """The last stage's output layer, fused with the loss. Its weight is read inside its own
    forward, never directly by the model: module hooks run before it is read (the overlapped
    parameter all-gather waits in one, ``parallel/ddp.py``)."""

    softcap: Optional[float] = None  # --final-logit-softcapping

    def forward(
        self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return logits_or_loss(x, self.weight, labels, loss_mask, self.group, self.sequence_parallel, self.softcap)


class M6Model(nn.Module):
    """One pipeline stage: its model chunks (virtual stages; one without interleaving).
    ``forward(..., chunk=c)`` takes token ids (first virtual stage) or the previous virtual
    stage's hidden states and returns hidden states, or on the last virtual stage the loss (per
    token, or the masked sum the schedules optimise).

    ``layer_calls[i]`` runs the stage's i-th layer (chunk by chunk): the layer module itself;
    ``offload.apply_offload`` replaces the entries of offloaded layers (``replace_layer_call``)
    with calls that fetch their weights from host.
    """

    def __init__(self, cfg: Config, ps: ParallelState, plan: ParallelPlan, device=None):
        super().__init__()
        m = cfg.model
        self.cfg, self.ps = cfg, ps
        self.sequence_parallel = sp = plan.sequence_parallel
        self.stage = stage = plan.stage(ps.pp_rank)
        self.layer_keys = list(stage.layer_keys)
        self.num_model_chunks = len(stage.chunks)
        starts = [0]
        for chunk in stage.chunks:
            starts.append(starts[-1] + len(chunk.layer_keys))
        self._chunk_calls = [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]  # positions in layer_calls
        selective = cfg.train.recompute == "selective"
        self.layers = nn.ModuleDict(
            {
                str(k): TransformerLayer(
                    m,
                    ps,
                    m.is_moe_layer(k),
                    device,
                    sequence_parallel=sp,
                    recompute_core=selective,
                    window=m.attention_window(k),
                    cp_comm_type=plan.cp_comm_type,
                )
                for k in stage.modules
            }
        )
        self.embedding = Embedding(cfg, ps, device, sequence_parallel=sp) if stage.first else None
        self.final_norm = make_norm(m, device) if stage.last else None
        self.output_layer = None
        tied = not m.untie_embeddings_and_output_weights
        if stage.last and not (tied and stage.first):
            self.output_layer = OutputLayer(
                m.hidden_size,
                m.padded_vocab_size,
                ps,
                bias=False,
                init_std=m.init_method_std,
                sequence_parallel=sp,
                device=device,
            )
            if tied:  # a replica of the first stage's embedding; gradients summed over the embedding group
                self.output_layer.weight.shared_name = WORD_EMBEDDING
            self.output_layer.softcap = m.final_logit_softcapping
        self.embedding_replica = None  # untied, for the MTP depths' lookups; gradients summed as the tied one's
        if holds_embedding_replica(m, stage.first, stage.last):
            self.embedding_replica = VocabParallelEmbedding(
                m.padded_vocab_size, m.hidden_size, ps, init_std=m.init_method_std, sequence_parallel=sp, device=device
            )
            self.embedding_replica.weight.shared_name = WORD_EMBEDDING
        self.mtp = None  # multi-token prediction (model/mtp.py): after every other parameter
        if stage.last and m.mtp_num_layers:
            self.mtp = MultiTokenPrediction(m, ps, device, sequence_parallel=sp)
        self.rope_base = m.rotary_base if m.position_embedding_type == "rope" or m.multi_latent_attention else None
        self.layer_calls: List[Callable] = [self.layers[str(k)] for k in self.layer_keys]
        self.standalone: Set[int] = set()  # layers whose calls recompute themselves
        self.recompute_units = self._recompute_units()

    def _recompute_units(self) -> List[List[Tuple[List[int], bool]]]:
        """Per model chunk, ``TrainConfig.recompute_units`` of its layers, as positions in
        ``layer_calls``."""
        out = []
        for calls in self._chunk_calls:
            units = self.cfg.train.recompute_units(len(calls), [p - calls.start for p in self.standalone if p in calls])
            out.append([([calls.start + i for i in unit], recomputed) for unit, recomputed in units])
        return out

    def layer_positions(self, chunk: int) -> range:
        """The positions in ``layer_calls`` of model chunk ``chunk``'s layers."""
        return self._chunk_calls[chunk]

    def recomputed_positions(self) -> Set[int]:
        """Positions in ``layer_calls`` of the layers recomputed in full."""
        return {p for chunk in self.recompute_units for unit, recomputed in chunk if recomputed for p in unit}

    def layer_nodes(self, position: int) -> Optional[LayerNodes]:
        """The stage's layer ``position`` cut at its expert all-to-alls (``moe/nodes.py``), each
        node recomputed when the layer is (the overlapped schedule refuses recomputed units of
        several layers: ``config/schedule.py``); None for a layer without all-to-alls (dense,
        EP=1) or whose call is replaced (offload): it runs whole, as ``layer_node``."""
        call = self.layer_calls[position]
        nodes = call.nodes() if isinstance(call, TransformerLayer) else None
        if nodes is None or position not in self.recomputed_positions():
            return nodes
        return nodes.recompute(self.ps.device)

    def layer_node(self, position: int) -> Callable:
        """The stage's layer ``position`` as one node, ``(x, rope) -> x``, recomputed in its
        backward (both RNG streams replayed) when the layer is."""
        call = self.layer_calls[position]
        if position not in self.recomputed_positions():
            return call
        return functools.partial(tp_random.checkpoint, call, device=self.ps.device)

    def replace_layer_call(self, position: int, call: Callable) -> None:
        """Run the stage's layer ``position`` with ``call``, which recomputes itself in backward
        (offload): it leaves the recomputed units."""
        self.layer_calls[position] = call
        self.standalone.add(position)
        self.recompute_units = self._recompute_units()

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.ps.tp_rank, self.ps.tp_size, self.ps.ep_rank)

    def rope(self, seq_len: int, device) -> Optional[tuple]:
        """The rotary tables every layer of a forward reads, at the positions of this rank's
        ``seq_len`` tokens (None without rotary positions)."""
        if self.rope_base is None:
            return None
        m, cp = self.cfg.model, self.ps.cp_size
        tables = latent_rotary_tables if m.multi_latent_attention else model_rotary_tables  # MLA: its own part, YaRN
        rope = tables(m, seq_len * cp, device)  # (cos, sin), or also the local ones (--rotary-base-local)
        if cp == 1:
            return rope
        positions = sequence_positions(self.ps, seq_len, device)
        return tuple(t[positions] for t in rope)

    def hidden_spec(self, tokens_shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the hidden states between stages for a micro-batch of
        ``tokens_shape``: the pipeline receiver allocates this instead of receiving a header.
        Under sequence parallelism it is this rank's sequence shard (1/TP of the tokens).
        The residual stream is in the parameters' dtype (16-bit with --bf16/--fp16)."""
        b, s = tokens_shape
        s = s // self.ps.tp_size if self.sequence_parallel else s
        return (b, s, self.cfg.model.hidden_size), next(self.parameters()).dtype

    def chunk_input(
        self, chunk: int, tokens: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[tuple]]:
        """Model chunk ``chunk``'s input: the embedded ``tokens`` on the first virtual stage, else
        ``hidden``; and the rotary tables its layers read."""
        x = self.embedding(tokens) if self.stage.chunks[chunk].first else hidden
        seq_length = x.shape[1] * (self.ps.tp_size if self.sequence_parallel else 1)
        return x, self.rope(seq_length, x.device)

    def forward(
        self,
        tokens: Optional[torch.Tensor] = None,
        hidden: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        chunk: int = 0,
        head_only: bool = False,
    ) -> torch.Tensor:
        """Hidden states of model chunk ``chunk``; on the last virtual stage logits ``[b, s, V/TP]``,
        or with ``labels`` per-token losses ``[b, s]`` — with ``loss_mask`` too, the scalar sum of
        loss x mask (the schedules' objective; its gradient computed with the loss: the output
        layer and the loss are fused, parallel/cross_entropy.py). ``head_only``: ``hidden`` is
        the last layer's output, only the final norm and the output layer run, and a chunk
        without them returns ``hidden`` itself (the overlapped expert schedule runs the embedding
        and the layers node by node, ``layer_nodes``, and calls this so that the model's hooks
        see each chunk's output)."""
        spec = self.stage.chunks[chunk]
        if head_only:
            return self._head(hidden, labels, loss_mask) if spec.last else hidden
        x, rope = self.chunk_input(chunk, tokens, hidden)
        for positions, recomputed in self.recompute_units[chunk]:
            if recomputed and torch.is_grad_enabled():
                x = tp_random.checkpoint(self._run_layers, positions, x, rope, device=self.ps.device)
            else:
                x = self._run_layers(positions, x, rope)
        return self._head(x, labels, loss_mask) if spec.last else x

    def _head(self, x: torch.Tensor, labels: Optional[torch.Tensor], loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.final_norm(x)
        out = self._output(x, labels, loss_mask)
        if self.mtp is None or loss_mask is None or labels is None or not torch.is_grad_enabled():
            return out
        seq_length = x.shape[1] * (self.ps.tp_size if self.sequence_parallel else 1)
        extra = self.mtp.loss(x, labels, loss_mask, self.rope(seq_length, x.device), self._mtp_embed, self._output)
        return attach(out, extra)

    def _output(self, x: torch.Tensor, labels: Optional[torch.Tensor], loss_mask: Optional[torch.Tensor]):
        if self.cfg.model.logits_scaling != 1.0:  # logits / s, as the output layer's input / s
            x = x / self.cfg.model.logits_scaling
        if self.output_layer is not None:
            return self.output_layer(x, labels, loss_mask)
        # tied weights on a single stage: the input embedding's, already gathered by its forward
        word = self.embedding.word_embeddings.weight
        group, softcap = self.ps.group("tp"), self.cfg.model.final_logit_softcapping
        return logits_or_loss(x, word, labels, loss_mask, group, self.sequence_parallel, softcap)

    def _mtp_embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input embedding of shifted ``ids`` at shifted ``positions`` (Megatron-LM rolls
        both) for multi-token prediction: the embedding module on a single stage, else a lookup
        in the last stage's replica of the input table: the tied output layer's weight (read
        after the output layer's forward), or untied ``embedding_replica``."""
        if self.embedding is not None:
            return self.embedding(ids, positions)
        word = (self.output_layer if self.embedding_replica is None else self.embedding_replica).weight
        reduce = reduce_scatter_to_sequence_region if self.sequence_parallel else reduce_from_region
        x = vocab_parallel_lookup(ids, word, self.ps.tp_rank * word.shape[0], self.ps.group("tp"), reduce)
        if self.cfg.model.embedding_multiplier != 1.0:  # as the embedding module's (Granite)
            x = x * self.cfg.model.embedding_multiplier
        p = self.cfg.model.hidden_dropout if self.training else 0.0
        return embedding_dropout(x, p, self.ps, self.sequence_parallel)

    def _run_layers(self, positions: Iterable[int], x: torch.Tensor, rope) -> torch.Tensor:
        for position in positions:
            x = self.layer_calls[position](x, rope)
        return x


def params_dtype(cfg: Config) -> torch.dtype:
    """The dtype of the weights: 16-bit with --bf16/--fp16 (the optimizer keeps fp32 mains), else fp32."""
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


def build_model(
    cfg: Config,
    ps: ParallelState,
    plan: Optional[ParallelPlan] = None,
    *,
    meta: bool = False,
    device: Optional[torch.device] = None,
) -> M6Model:
    """Build this rank's stage of ``plan`` (default: the plan of ``cfg`` on ``ps.layout``) on
    ``device`` (default ``ps.device``), weights in ``params_dtype(cfg)`` (initialised in fp32,
    then rounded); on ``meta`` nothing is allocated or initialised."""
    plan = plan or ParallelPlan.build(cfg, ps.layout)
    device = torch.device("meta") if meta else (device or ps.device)
    model = M6Model(cfg, ps, plan, device=device)
    if not meta:
        model.init_weights(cfg.train.seed)
    return model.to(params_dtype(cfg))
