"""Megatron-LM's distributed optimizer state in a torch_dist checkpoint as ``--use-distributed-optimizer
--ckpt-format torch_dist`` writes it by default: sharding type ``dp_reshardable``
(``DistributedOptimizer.sharded_param_state_dp_reshardable``), the optimizer's own buckets.

    [chained_I.]optimizer.distributed.dp_group_idx_M.gbuf_idx_0.dtype_(param dtype, grad dtype).bucket_idx_B.STATE
        [the bucket's elements without its end padding]     STATE: param (fp32 main), exp_avg, exp_avg_sq
    [chained_I.]optimizer.distributed.dp_group_idx_M.optimizer   a pickled object: the param groups, with Adam's step

M is the rank in the model-parallel group (``pp * TP + tp``): each TP shard of each pipeline
stage has its own buckets, each DP rank wrote its slice of them. An MoE model under expert
parallelism has two optimizers (megatron-core's ChainedOptimizer): ``chained_0`` the dense
parameters', ``chained_1`` the experts', whose M is the rank in the expert tensor-model-pipeline
group (``(pp * EP + ep) * TP + tp``): each EP rank's experts have buckets of their own. Nothing
says where a parameter lies in its bucket; the DDP buffer's layout does (``buffer_layout``),
replayed here from the stage's parameters in the order megatron-core's GPTModel with the local
layer spec registers them (``named_parameters``). The replayed bucket lengths are checked against
the saved tensors before a value is read. The experts are replayed as the local spec holds them:
``SequentialMLP``'s ``local_experts.i.linear_fc1.weight`` (``.bias``) and ``linear_fc2.weight``
(``.bias``), expert after expert, or ``--moe-grouped-gemm``'s ``GroupedMLP``: per layer
``weight1`` [h, local experts x fc1 rows / TP] and ``weight2`` [local experts x ffn / TP, h], each
expert's block transposed. Not replayed (the import is then of weights only, and says why):
Transformer Engine's modules, experts outside expert parallelism (in the dense buffer), experts
with their own TP size, grouped-GEMM experts with biases (megatron-core refuses them too), uneven
pipeline splits, and MTP layers with a tied embedding under PP > 1. With MTP under PP > 1
(untied) the last stage holds a replica of the embedding, a bucket of its own as the first
stage's embedding is (megatron-core's ``shared_embedding``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.args import SavedArgs
from megatron_p2r.convert.megatron.buffer_layout import Param, bucket_layout, bucket_size
from megatron_p2r.convert.megatron.names import (
    FINAL_NORM,
    MTP_LAYER,
    OUTPUT_LAYER,
    is_buffer,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    join_tp_shards,
    split_any_layer,
    split_layer_key,
    tp_dim,
)

SHARDING_TYPE = "dp_reshardable"
# our optimizer-state kind -> Megatron's state name in the bucket keys
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main": "param"}
_KEY = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))\.bucket_idx_(\d+)\."
    r"(param|exp_avg|exp_avg_sq)"
)
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(linear_fc[12])\.(weight|bias)")
DENSE, EXPERTS = "chained_0.", "chained_1."  # a ChainedOptimizer's keys: the dense optimizer's, the experts'
# a layer's modules in the order megatron-core's local-spec TransformerLayer registers them
# (Attention builds linear_proj before SelfAttention adds linear_qkv and the q/k norms; MoELayer
# its router before its experts)
_LAYER_MODULES = (
    "input_layernorm",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "self_attention.linear_q_proj",
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
    "self_attention.q_layernorm",
    "self_attention.k_layernorm",
    "self_attention.kv_layernorm",
    "pre_mlp_layernorm",
    "mlp.router",
    "mlp.shared_experts",  # gate_weight
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# an MTP depth's modules in registration order (its transformer layer's in _LAYER_MODULES order)
_MTP_MODULES = ("enorm", "hnorm", "eh_proj", "transformer_layer", "final_layernorm")
_MTP_OWN = re.compile(r"mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|final_layernorm)\.weight")
# the last stage's replica of the embedding under MTP (no weight of ours: its state is the first
# stage's embedding's, kept equal by the embedding group's gradient all-reduce)
_EMBEDDING_REPLICA = "embedding.word_embeddings.weight (the MTP stage's replica)"
_UNEVEN_SPLITS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


class NotReplayed(Exception):
    """The buffers of this model are not replayed here: why (the import is of weights only)."""


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where one TP shard of a weight's state lies: a bucket's elements ``start`` on, ``shape``
    as the rank holds it (``transposed``: [in, out], a GroupedMLP expert's block)."""

    bucket: str
    start: int
    shape: Tuple[int, ...]
    transposed: bool = False


def module_order(name: str) -> Tuple[int, ...]:
    """Where a canonical weight comes in megatron-core's ``named_parameters`` (local layer spec)."""
    module, _, leaf = name.rpartition(".")
    split, mtp, own = split_layer_key(name), MTP_LAYER.fullmatch(name), _MTP_OWN.fullmatch(name)
    if name == WORD_EMBEDDINGS:
        return (0,)
    if name == POSITION_EMBEDDINGS:
        return (1,)
    if split is not None and split[0] is not None and split[1].rpartition(".")[0] in _LAYER_MODULES:
        return (2, split[0], _LAYER_MODULES.index(split[1].rpartition(".")[0]), leaf != "weight")
    if name.startswith(FINAL_NORM):
        return (3, leaf != "weight")
    if own:  # after the decoder, as GPTModel builds its MultiTokenPredictionBlock
        return (4, int(own.group(1)), _MTP_MODULES.index(own.group(2)))
    if mtp and mtp.group(2).rpartition(".")[0] in _LAYER_MODULES:
        depth = int(mtp.group(1).split(".")[2])
        return (
            4,
            depth,
            _MTP_MODULES.index("transformer_layer"),
            _LAYER_MODULES.index(mtp.group(2).rpartition(".")[0]),
        )
    if name == OUTPUT_LAYER:
        return (5,)
    raise NotReplayed(f"where megatron-core registers {module} is not known here")


def is_expert(name: str) -> bool:
    split = split_any_layer(name)
    return split is not None and split[1].startswith("mlp.experts.")


class DpReshardable:
    """Each weight's optimizer state, from the bucket tensors of every (TP rank, stage) and, with
    experts, every (TP rank, EP rank, stage)."""

    def __init__(
        self,
        args: SavedArgs,
        shapes: Dict[str, Tuple[int, ...]],
        sizes: Dict[str, Tuple[int, ...]],
        read_range: Callable[[str, int, int], torch.Tensor],
        where: str,
    ):
        """``shapes``: the global shape of every weight; ``sizes``: the global shape of every key
        of the checkpoint; ``read_range(key, start, stop)``: elements of a flat key."""
        shapes = {n: shape for n, shape in shapes.items() if not is_buffer(n)}  # the routers' expert biases
        chained = _check_replayable(args, shapes, sizes)
        self.args, self.where, self._read_range = args, where, read_range
        self._shapes, self._sizes = shapes, sizes
        # weight -> TP rank -> where its TP shard's state lies
        self.places: Dict[str, Dict[int, _Place]] = {}
        self.param_group_keys: List[str] = []  # the pickled param groups of every optimizer and rank
        self._chunks = _model_chunks(args)
        dense = self._buckets(DENSE if chained else "", args.tp * args.pp)
        experts = self._buckets(EXPERTS, args.tp * args.ep * args.pp) if chained else {}
        for chunk in range(self._chunks):
            for stage in range(args.pp):
                for t in range(args.tp):
                    self._place_dense(dense, chunk, stage, t)
                    for e in range(args.ep if chained else 0):
                        self._place_experts(experts, chunk, stage, e, t)
        self.names = {kind: dict.fromkeys(self.places) for kind in STATES}

    def _buckets(self, prefix: str, ranks: int) -> Dict[Tuple[int, int], Tuple[str, List[int]]]:
        """(dp_group_idx, gbuf_idx: the model chunk) -> (its buffer's key prefix, its buckets'
        lengths) of one optimizer."""
        found = _bucket_keys(
            {k[len(prefix) :]: v for k, v in self._sizes.items() if k.startswith(prefix)},
            ranks,
            self._chunks,
            f"{self.where} ({prefix[:-1] or 'the optimizer'})",
        )
        self.param_group_keys += [f"{prefix}optimizer.distributed.dp_group_idx_{i}.optimizer" for i in range(ranks)]
        return {
            (i, g): (f"{prefix}optimizer.distributed.dp_group_idx_{i}.gbuf_idx_{g}.dtype_{dtype}", lengths)
            for (i, g), (dtype, lengths) in found.items()
        }

    def _virtual_stage(self, chunk: int, stage: int) -> Tuple[int, int]:
        """(virtual stage, their count) of model chunk ``chunk`` of pipeline rank ``stage``."""
        return chunk * self.args.pp + stage, self._chunks * self.args.pp

    def _place_dense(self, buckets, chunk: int, stage: int, t: int) -> None:
        """Where TP rank ``t`` of pipeline rank ``stage`` keeps the dense state of model chunk ``chunk``."""
        virtual, count = self._virtual_stage(chunk, stage)
        names = [
            n
            for n in self._shapes
            if _on_stage(n, virtual, count, self.args.required("num_layers")) and not is_expert(n)
        ]
        params = self._stage_params(names, virtual == count - 1)
        where = f"TP rank {t}, stage {stage}" + (f", model chunk {chunk}" if self._chunks > 1 else "")
        bucket, starts = self._replay(
            buckets,
            (stage * self.args.tp + t, chunk),
            params,
            bucket_size(self.args, stage) if chunk == 0 else None,
            where,
        )
        for p in params:
            if p.key in self._shapes:
                self.places.setdefault(p.key, {})[t] = _Place(
                    bucket(starts[p.key][0]), starts[p.key][1], self._local_shape(p.key)
                )

    def _replay(
        self,
        buckets: Dict[Tuple[int, int], Tuple[str, List[int]]],
        index: Tuple[int, int],
        params: List[Param],
        size: Optional[int],
        rank: str,
    ) -> Tuple[Callable[[int], str], Dict[str, Tuple[int, int]]]:
        """The layout of one rank's buffer of ``params`` (buckets of ``size``), checked against its
        saved buckets: (bucket number -> its key without the state, each parameter's (bucket, start))."""
        prefix, lengths = buckets[index]
        starts, replayed = bucket_layout(params, size)
        if replayed != lengths:
            group = prefix.partition(".dtype_")[0].replace("optimizer.distributed.", "")
            group = group if self._chunks > 1 else group.partition(".gbuf_idx")[0]
            raise CheckpointError(
                f"{self.where}: the buckets of {group} ({rank}) hold {lengths} elements, the layout "
                f"of the stage's {len(params)} parameters in Megatron's buffer has {replayed}"
            )
        return (lambda b: f"{prefix}.bucket_idx_{b}"), starts

    def _place_experts(self, buckets, chunk: int, stage: int, ep: int, t: int) -> None:
        """Where TP rank ``t`` of EP rank ``ep`` keeps the state of its experts in each MoE layer
        of the (virtual) stage: SequentialMLP's weights, or GroupedMLP's blocks of them."""
        args, local = self.args, self.args.required("num_experts") // self.args.ep
        virtual, count = self._virtual_stage(chunk, stage)
        moe_layers = sorted(
            {
                split_any_layer(n)[0]
                for n in self._shapes
                if is_expert(n) and _on_stage(n, virtual, count, args.required("num_layers"))
            },
            key=lambda prefix: module_order(prefix + "input_layernorm.weight"),
        )
        params, blocks = [], []
        for layer in moe_layers:
            experts = self._grouped_experts if args.get("moe_grouped_gemm") else self._sequential_experts
            layer_params, layer_blocks = experts(layer, ep, local)
            params, blocks = params + layer_params, blocks + layer_blocks
        index = (stage * args.ep + ep) * args.tp + t
        where = f"TP rank {t}, EP rank {ep}, stage {stage}" + (f", model chunk {chunk}" if self._chunks > 1 else "")
        bucket, starts = self._replay(
            buckets, (index, chunk), params, bucket_size(args, stage) if chunk == 0 else None, where
        )
        for key, name, offset, shape, transposed in blocks:
            b, start = starts[key]
            self.places.setdefault(name, {})[t] = _Place(bucket(b), start + offset, shape, transposed)

    def _sequential_experts(self, layer: str, ep: int, local: int) -> Tuple[List[Param], List[tuple]]:
        """SequentialMLP's parameters of one MoE layer (``layer``: its prefix) on EP rank ``ep``
        (``local_experts.i.linear_fc1``, ``linear_fc2`` of each local expert in turn, as its
        ModuleList registers them, each its weight then its bias), and where each canonical expert
        weight lies in them: (parameter, name, offset, shape, transposed)."""
        params, blocks = [], []
        for i in range(local):
            for fc in ("linear_fc1", "linear_fc2"):
                for leaf in ("weight", "bias"):  # a linear layer builds its weight, then its bias
                    name = f"{layer}mlp.experts.{ep * local + i}.{fc}.{leaf}"
                    if name not in self._shapes:
                        continue
                    key, shape = f"{layer}mlp.experts.local_experts.{i}.{fc}.{leaf}", self._local_shape(name)
                    params.append(Param(key, shape, True))
                    blocks.append((key, name, 0, shape, False))
        return params, blocks

    def _grouped_experts(self, layer: str, ep: int, local: int) -> Tuple[List[Param], List[tuple]]:
        """GroupedMLP's ``weight1`` and ``weight2`` of one MoE layer (``layer``: its prefix) on EP
        rank ``ep``, and where each local expert's block lies in them (the linear layer's weight
        transposed)."""
        params, blocks = [], []
        for fc, weight in (("linear_fc1", "weight1"), ("linear_fc2", "weight2")):
            out, in_ = self._local_shape(f"{layer}mlp.experts.0.{fc}.weight")
            block = (in_, out)  # GroupedMLP's expert weight is the linear layer's transposed
            # weight1 [h, experts x out]: viewed as [experts, h, out]; weight2 [experts x in, h]
            local_shape = (in_, local * out) if weight == "weight1" else (local * in_, out)
            key = f"{layer}mlp.experts.{weight}"
            params.append(Param(key, local_shape, True))
            blocks += [
                (key, f"{layer}mlp.experts.{ep * local + i}.{fc}.weight", i * math.prod(block), block, True)
                for i in range(local)
            ]
        return params, blocks

    def _stage_params(self, names: List[str], last: bool) -> List[Param]:
        """The (virtual) stage's dense parameters (TP shards) in ``named_parameters`` order. Under
        PP > 1 the last stage holds a replica of the embedding where the embedding is tied or the
        model has MTP layers (megatron-core's ``shared_embedding``): the tied output layer's weight
        (``output_layer.weight``, registered last) or, with MTP, the MTP depths' input embedding
        (``embedding.word_embeddings.weight``, registered first, beside an untied output layer);
        the replica and the first stage's embedding are each a bucket of their own (MTP with a
        tied embedding under PP > 1: not replayed, ``_check_replayable``)."""
        mtp = bool(self.args.get("mtp_num_layers"))
        shared = self.args.pp > 1 and (mtp or not self.args.get("untie_embeddings_and_output_weights"))
        params = [
            Param(n, self._local_shape(n), False, shared and n == WORD_EMBEDDINGS)
            for n in sorted(names, key=module_order)
        ]
        if not (shared and last):
            return params
        if not mtp:  # the tied output layer holds it: its state is the first stage's embedding's
            return params + [Param(OUTPUT_LAYER, self._local_shape(OUTPUT_LAYER), False, True)]
        replica = Param(_EMBEDDING_REPLICA, self._local_shape(WORD_EMBEDDINGS), False, True)
        return [replica] + params

    def _local_shape(self, name: str) -> Tuple[int, ...]:
        """The TP shard's shape (a tied embedding's last-stage copy: the embedding's)."""
        shape = self._shapes[WORD_EMBEDDINGS if name == OUTPUT_LAYER and name not in self._shapes else name]
        dim = tp_dim(name)
        if dim is None:
            return shape
        if shape[dim] % self.args.tp:
            raise CheckpointError(
                f"{self.where}: {name} has {shape[dim]} rows on its TP dimension, not divisible by "
                f"args.tensor_model_parallel_size {self.args.tp}"
            )
        return shape[:dim] + (shape[dim] // self.args.tp,) + shape[dim + 1 :]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, kind: str) -> torch.Tensor:
        """The global state ``kind`` of weight ``name``: its TP shards' slices of their buckets,
        joined along Megatron's split dim."""
        parts = []
        for t in range(self.args.tp):
            place = self.places[name][t]
            part = self._read_range(
                f"{place.bucket}.{STATES[kind]}", place.start, place.start + math.prod(place.shape)
            ).reshape(place.shape)
            parts.append(part.t().contiguous() if place.transposed else part)
        return join_tp_shards(name, parts, bool(self.args.get("swiglu")))


def _check_replayable(args: SavedArgs, shapes: Dict[str, Tuple[int, ...]], sizes: Dict[str, Tuple[int, ...]]) -> bool:
    """Whether the optimizer is chained (dense, experts); NotReplayed where the buffers are not."""
    if args.get("transformer_impl", default="transformer_engine") != "local":
        raise NotReplayed(
            "the order of Transformer Engine's modules in the distributed optimizer's buffers is not "
            "replayed yet (only --transformer-impl local)"
        )
    chained = any(k.startswith(DENSE) for k in sizes)
    experts = [n for n in shapes if is_expert(n)]
    if experts and not chained:
        raise NotReplayed(
            "an MoE model's experts outside expert parallelism (EP 1: in the dense optimizer's "
            "buffers) are not replayed yet"
        )
    if experts and (
        args.get("expert_tensor_parallel_size") not in (None, args.tp)
        or any(not _EXPERT.fullmatch(split_any_layer(n)[1]) for n in experts)
        or (args.get("moe_grouped_gemm") and any(n.endswith(".bias") for n in experts))
    ):
        raise NotReplayed(
            "the buffers of experts with their own TP size, or of grouped-GEMM experts with biases, are not replayed yet"
        )
    if args.pp > 1 and args.get("mtp_num_layers") and not args.get("untie_embeddings_and_output_weights"):
        raise NotReplayed(
            "the buffers of MTP layers with a tied embedding under PP > 1 are not replayed yet "
            "(with --untie-embeddings-and-output-weights they are)"
        )
    uneven = [f"--{a.replace('_', '-')}" for a in _UNEVEN_SPLITS if args.get(a)]
    if uneven or args.required("num_layers") % (args.pp * _model_chunks(args)):
        raise NotReplayed(
            f"the buffers of an uneven pipeline split ({', '.join(uneven) or 'num_layers % PP'}) are not replayed yet"
        )
    return chained


def _model_chunks(args: SavedArgs) -> int:
    """Model chunks per pipeline rank (virtual pipeline stages), each with its own buffer."""
    return int(args.get("virtual_pipeline_model_parallel_size") or 1) if args.pp > 1 else 1


def _bucket_keys(
    sizes: Dict[str, Tuple[int, ...]], ranks: int, chunks: int, where: str
) -> Dict[Tuple[int, int], Tuple[str, List[int]]]:
    """(dp_group_idx, gbuf_idx) -> (its buffer's dtype pair, its buckets' lengths), from the saved keys."""
    found: Dict[int, Dict[Tuple[int, str, int, str], int]] = {}
    for key, size in sizes.items():
        m = _KEY.fullmatch(key)
        if m:
            found.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3), int(m.group(4)), m.group(5))] = size[0]
    if sorted(found) != list(range(ranks)):
        raise CheckpointError(
            f"{where}: holds the distributed optimizer's buckets of dp_group_idx {sorted(found)}, "
            f"expected 0..{ranks - 1} (one per model-parallel rank)"
        )
    out = {}
    for index, buckets in found.items():
        buffers = sorted({(gbuf, dtype) for gbuf, dtype, _, _ in buckets})
        if [gbuf for gbuf, _ in buffers] != list(range(chunks)):
            raise NotReplayed(
                f"dp_group_idx_{index} holds grad buffers {buffers}; one per model chunk "
                f"(gbuf_idx_0..{chunks - 1}, of one dtype each) is replayed"
            )
        for gbuf, dtype in buffers:
            count = 1 + max(b for g, _, b, _ in buckets if g == gbuf)
            lengths = []
            for b in range(count):
                per_state = {buckets.get((gbuf, dtype, b, s)) for s in STATES.values()}
                if len(per_state) != 1 or None in per_state:
                    raise CheckpointError(
                        f"{where}: bucket {b} of dp_group_idx_{index} gbuf_idx_{gbuf} has states of "
                        f"lengths {per_state}, expected {sorted(STATES.values())} of one length"
                    )
                lengths.append(per_state.pop())
            out[(index, gbuf)] = (dtype, lengths)
    return out


def _on_stage(name: str, stage: int, pp: int, layers: int) -> bool:
    """Whether pipeline stage ``stage`` of an even split holds weight ``name``."""
    split = split_layer_key(name)
    if split is not None and split[0] is not None:
        return split[0] // (layers // pp) == stage
    if name in (WORD_EMBEDDINGS, POSITION_EMBEDDINGS):
        return stage == 0
    return stage == pp - 1
