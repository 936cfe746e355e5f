"""Megatron-LM's distributed optimizer state in a torch_dist checkpoint as ``--use-distributed-optimizer
--ckpt-format torch_dist`` writes it by default: sharding type ``dp_reshardable``
(``DistributedOptimizer.sharded_param_state_dp_reshardable``), the optimizer's own buckets.

    optimizer.distributed.dp_group_idx_M.gbuf_idx_0.dtype_(param dtype, grad dtype).bucket_idx_B.STATE
        [the bucket's elements without its end padding]     STATE: param (fp32 main), exp_avg, exp_avg_sq
    optimizer.distributed.dp_group_idx_M.optimizer          a pickled object: the param groups, with Adam's step

M is the rank in the model-parallel group (``pp * TP + tp``): each TP shard of each pipeline
stage has its own buckets, each DP rank wrote its slice of them. Nothing says where a parameter
lies in its bucket; the DDP buffer's layout does (``buffer_layout``), replayed here from the
stage's parameters in the order megatron-core's GPTModel with the local layer spec registers them
(``named_parameters``). The replayed bucket lengths are checked against the saved tensors before
a value is read. Not replayed (the import is then of weights only, and says why): Transformer
Engine's modules, MoE (a second optimizer for the experts), virtual pipeline chunks and uneven
pipeline splits.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.args import SavedArgs
from megatron_p2r.convert.megatron.buffer_layout import Param, bucket_layout, bucket_size
from megatron_p2r.convert.megatron.names import (FINAL_NORM, OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS,
                                                    join_tp_shards, split_layer_key, tp_dim)

SHARDING_TYPE = "dp_reshardable"
# our optimizer-state kind -> Megatron's state name in the bucket keys
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main": "param"}
_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))\.bucket_idx_(\d+)\."
                  r"(param|exp_avg|exp_avg_sq)")
# a layer's modules in the order megatron-core's local-spec TransformerLayer registers them
# (Attention builds linear_proj before SelfAttention adds linear_qkv and the q/k norms)
_LAYER_MODULES = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
                  "self_attention.q_layernorm", "self_attention.k_layernorm", "pre_mlp_layernorm",
                  "mlp.linear_fc1", "mlp.linear_fc2")
_UNEVEN_SPLITS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                  "account_for_loss_in_pipeline_split")


class NotReplayed(Exception):
    """The buffers of this model are not replayed here: why (the import is of weights only)."""


def module_order(name: str) -> Tuple[int, ...]:
    """Where a canonical weight comes in megatron-core's ``named_parameters`` (local layer spec)."""
    module, _, leaf = name.rpartition(".")
    split = split_layer_key(name)
    if name == WORD_EMBEDDINGS:
        return (0,)
    if name == POSITION_EMBEDDINGS:
        return (1,)
    if split is not None and split[0] is not None and split[1].rpartition(".")[0] in _LAYER_MODULES:
        return (2, split[0], _LAYER_MODULES.index(split[1].rpartition(".")[0]), leaf != "weight")
    if name.startswith(FINAL_NORM):
        return (3, leaf != "weight")
    if name == OUTPUT_LAYER:
        return (4,)
    raise NotReplayed(f"where megatron-core registers {module} is not known here")


class DpReshardable:
    """Each weight's optimizer state, from the bucket tensors of every (TP rank, stage)."""

    def __init__(self, args: SavedArgs, shapes: Dict[str, Tuple[int, ...]], sizes: Dict[str, Tuple[int, ...]],
                 read_range: Callable[[str, int, int], torch.Tensor], where: str):
        """``shapes``: the global shape of every weight; ``sizes``: the global shape of every key
        of the checkpoint; ``read_range(key, start, stop)``: elements of a flat key."""
        _check_replayable(args, sizes)
        self.args, self.where, self._read_range = args, where, read_range
        self._shapes = shapes
        buckets = _bucket_keys(sizes, args.tp * args.pp, where)
        # weight -> TP rank -> (dp_group_idx, bucket, start): where its TP shard's state lies
        self.places: Dict[str, Dict[int, Tuple[int, int, int]]] = {}
        self._dtype: Dict[int, str] = {}
        layers = args.required("num_layers")
        for stage in range(args.pp):
            names = [n for n in shapes if _on_stage(n, stage, args.pp, layers)]
            for t in range(args.tp):
                index = stage * args.tp + t
                self._dtype[index], lengths = buckets[index]
                params = self._stage_params(names, stage)
                starts, replayed = bucket_layout(params, bucket_size(args, stage))
                if replayed != lengths:
                    raise CheckpointError(f"{where}: the buckets of dp_group_idx_{index} (TP rank {t}, stage {stage}) "
                                          f"hold {lengths} elements, the layout of the stage's {len(params)} parameters "
                                          f"in Megatron's buffer has {replayed}")
                for p in params:
                    if p.key in shapes:
                        self.places.setdefault(p.key, {})[t] = (index, *starts[p.key])
        self.names = {kind: dict.fromkeys(self.places) for kind in STATES}

    def _stage_params(self, names: List[str], stage: int) -> List[Param]:
        """The stage's parameters (TP shards) in ``named_parameters`` order; with a tied
        embedding under PP > 1, the last stage's copy (``output_layer.weight``) and the first
        stage's embedding are each a bucket of their own."""
        tied = not self.args.get("untie_embeddings_and_output_weights") and self.args.pp > 1
        names = names + ([OUTPUT_LAYER] if tied and stage == self.args.pp - 1 else [])
        return [Param(n, self._local_shape(n), False, tied and n in (WORD_EMBEDDINGS, OUTPUT_LAYER))
                for n in sorted(names, key=module_order)]

    def _local_shape(self, name: str) -> Tuple[int, ...]:
        """The TP shard's shape (a tied embedding's last-stage copy: the embedding's)."""
        shape = self._shapes[WORD_EMBEDDINGS if name == OUTPUT_LAYER and name not in self._shapes else name]
        dim = tp_dim(name)
        if dim is None:
            return shape
        if shape[dim] % self.args.tp:
            raise CheckpointError(f"{self.where}: {name} has {shape[dim]} rows on its TP dimension, not divisible by "
                                  f"args.tensor_model_parallel_size {self.args.tp}")
        return shape[:dim] + (shape[dim] // self.args.tp,) + shape[dim + 1:]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, kind: str) -> torch.Tensor:
        """The global state ``kind`` of weight ``name``: its TP shards' slices of their buckets,
        joined along Megatron's split dim."""
        parts = []
        for t in range(self.args.tp):
            index, bucket, start = self.places[name][t]
            shape = self._local_shape(name)
            key = f"optimizer.distributed.dp_group_idx_{index}.gbuf_idx_0.dtype_{self._dtype[index]}." \
                  f"bucket_idx_{bucket}.{STATES[kind]}"
            parts.append(self._read_range(key, start, start + math.prod(shape)).reshape(shape))
        return join_tp_shards(name, parts, bool(self.args.get("swiglu")))


def _check_replayable(args: SavedArgs, sizes: Dict[str, Tuple[int, ...]]) -> None:
    if args.get("transformer_impl", default="transformer_engine") != "local":
        raise NotReplayed("the order of Transformer Engine's modules in the distributed optimizer's buffers is not "
                          "replayed yet (only --transformer-impl local)")
    if any(k.startswith("chained_") for k in sizes):
        raise NotReplayed("the buffers of an MoE model's two distributed optimizers (chained_0, chained_1) are not "
                          "replayed yet")
    if args.pp > 1 and args.get("virtual_pipeline_model_parallel_size"):
        raise NotReplayed("the buffers of virtual pipeline model chunks are not replayed yet")
    uneven = [f"--{a.replace('_', '-')}" for a in _UNEVEN_SPLITS if args.get(a)]
    if uneven or args.required("num_layers") % args.pp:
        raise NotReplayed(f"the buffers of an uneven pipeline split ({', '.join(uneven) or 'num_layers % PP'}) "
                          "are not replayed yet")


def _bucket_keys(sizes: Dict[str, Tuple[int, ...]], ranks: int, where: str) -> Dict[int, Tuple[str, List[int]]]:
    """dp_group_idx -> (its buffer's dtype pair, its buckets' lengths), from the saved keys."""
    found: Dict[int, Dict[Tuple[int, str, int, str], int]] = {}
    for key, size in sizes.items():
        m = _KEY.fullmatch(key)
        if m:
            found.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3), int(m.group(4)), m.group(5))] = size[0]
    if sorted(found) != list(range(ranks)):
        raise CheckpointError(f"{where}: holds the distributed optimizer's buckets of dp_group_idx {sorted(found)}, "
                              f"expected 0..{ranks - 1} (one per TP rank and pipeline stage)")
    out = {}
    for index, buckets in found.items():
        buffers = {(gbuf, dtype) for gbuf, dtype, _, _ in buckets}
        if len(buffers) != 1 or next(iter(buffers))[0] != 0:
            raise NotReplayed(f"dp_group_idx_{index} holds grad buffers {sorted(buffers)}; only one (gbuf_idx_0) "
                              "is replayed")
        count = 1 + max(b for _, _, b, _ in buckets)
        lengths = []
        for b in range(count):
            per_state = {buckets.get((0, next(iter(buffers))[1], b, s)) for s in STATES.values()}
            if len(per_state) != 1 or None in per_state:
                raise CheckpointError(f"{where}: bucket {b} of dp_group_idx_{index} has states of lengths {per_state}, "
                                      f"expected {sorted(STATES.values())} of one length")
            lengths.append(per_state.pop())
        out[index] = (next(iter(buffers))[1], lengths)
    return out


def _on_stage(name: str, stage: int, pp: int, layers: int) -> bool:
    """Whether pipeline stage ``stage`` of an even split holds weight ``name``."""
    split = split_layer_key(name)
    if split is not None and split[0] is not None:
        return split[0] // (layers // pp) == stage
    if name in (WORD_EMBEDDINGS, POSITION_EMBEDDINGS):
        return stage == 0
    return stage == pp - 1
