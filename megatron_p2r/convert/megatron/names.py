"""Megatron-LM's tensor names and TP splits (megatron/core/models/gpt/gpt_model.py,
gpt_layer_specs.py, tensor_parallel/layers.py), reduced to one *canonical* name per global
tensor: per layer with its global index, per expert with its global index.

    embedding.word_embeddings.weight             [padded vocab, h]      split over TP on dim 0
    embedding.position_embeddings.weight         [max positions, h]     (learned_absolute)
    decoder.layers.N.input_layernorm.{weight,bias}                      TE: self_attention.linear_qkv.layer_norm_*
    decoder.layers.N.self_attention.linear_qkv.{weight,bias}            column-parallel (dim 0)
    decoder.layers.N.self_attention.linear_proj.{weight,bias}           row-parallel (weight dim 1)
    decoder.layers.N.self_attention.core_attention.softmax_offset [heads]  --softmax-type learnable, split over TP
    decoder.layers.N.self_attention.linear_{q,kv}_{down,up}_proj.weight, linear_q_proj.weight,
        {q,kv}_layernorm.weight                                         --multi-latent-attention (local spec)
    decoder.layers.N.pre_mlp_layernorm.{weight,bias}                    TE: mlp.linear_fc1.layer_norm_*
    decoder.layers.N.mlp.linear_fc1.{weight,bias}                       column-parallel; gated (SwiGLU, quick-GeGLU): [gate; up]
    decoder.layers.N.mlp.linear_fc2.{weight,bias}                       row-parallel
    decoder.layers.N.mlp.router.weight           [experts, h]
    decoder.layers.N.mlp.router.expert_bias      [experts]              --moe-router-enable-expert-bias (a buffer)
    decoder.layers.N.mlp.experts.E.linear_fc{1,2}.{weight,bias}        as the dense MLP, per expert
    decoder.layers.N.mlp.shared_experts.linear_fc{1,2}.weight           as the dense MLP
    decoder.layers.N.mlp.shared_experts.gate_weight [1, h]              --moe-shared-expert-gate
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                          [padded vocab, h]      (untied only)
    mtp.layers.D.{enorm,hnorm,final_layernorm}.weight, mtp.layers.D.eh_proj.weight [h, 2h]
    mtp.layers.D.transformer_layer.REST          a layer's tensors (REST as above) --mtp-num-layers

A canonical gated ``linear_fc1`` is the global [gate rows; up rows] that torch_dist stores
(``mlp.apply_swiglu_sharded_factory``); each TP shard of a legacy file is [its gate; its up].
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Tuple

import torch

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm."
LAYERS = "decoder.layers."

# Transformer Engine fuses the norms into the next linear layer; the local spec keeps them apart
# (torch_dist renames both to the TE names: gpt_layer_specs' sharded_state_dict_keys_map).
_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# Entries that are not weights: Transformer Engine's FP8 metadata, rotary frequency buffers.
IGNORED = re.compile(r"(\._extra_state$|\.inv_freq$)")
_LEGACY_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))"
    r"|(linear_fc[12]\.(?:weight|bias))(\d+))"
)
_LAYER_KEY = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")
MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.transformer_layer\.)(.+)")


# a router's buffer (--moe-router-enable-expert-bias): a tensor of the checkpoint, no parameter
EXPERT_BIAS = "mlp.router.expert_bias"


def is_buffer(name: str) -> bool:
    """Whether canonical ``name`` is a module buffer (no parameter, no optimizer state)."""
    return name.endswith("." + EXPERT_BIAS)


def bias_megatron_name(ours: str) -> str:
    """Megatron's canonical name of our router bias ``ours`` (``layers.K.mlp.router.expert_bias``
    or an MTP depth's ``mtp.layers.D.layer.mlp.router.expert_bias``: moe/expert_bias.py)."""
    return f"decoder.{ours}" if ours.startswith("layers.") else ours.replace(".layer.", ".transformer_layer.", 1)


def layer_name(layer: int, rest: str) -> str:
    return f"{LAYERS}{layer}.{_NORM_ALIASES.get(rest, rest)}"


def expert_rest(expert: int, leaf: str) -> str:
    return f"mlp.experts.{expert}.{leaf}"


def mtp_layer_name(prefix: str, rest: str) -> str:
    """The canonical name of an MTP layer's tensor (``prefix``: ``mtp.layers.D.transformer_layer.``)."""
    return prefix + _NORM_ALIASES.get(rest, rest)


_TE_NAMES = {local: te for te, local in _NORM_ALIASES.items()}
_EXPERT_REST = re.compile(r"mlp\.experts\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class DistNaming:
    """How megatron-core's sharded state dict names a model's layers: stacked [L, ...] (the same
    layer everywhere) or one key per layer (``per_layer``: --moe-layer-freq other than 1, as
    ``TransformerBlock.sharded_state_dict`` decides), and the norms under the Transformer-Engine
    names (``te_norms``: the local spec maps them so, except with multi-latent attention)."""

    per_layer: bool = False
    te_norms: bool = True


def dist_key(name: str, naming: DistNaming = DistNaming()) -> Tuple[str, Tuple[int, ...]]:
    """A canonical name -> (its torch_dist key, its index on the key's leading dimensions):
    layers stacked as ``decoder.layers.rest`` [L, ...] (or ``decoder.layers.N.rest``), experts as
    ``decoder.layers.mlp.experts.experts.leaf`` [L, E, ...] (megatron-core's sharded keys); an
    MTP layer's as a layer of its own (``mtp.layers.D.transformer_layer.rest``)."""
    mtp = MTP_LAYER.fullmatch(name)
    split = split_layer_key(name)
    if mtp is None and (split is None or split[0] is None):
        return name, ()
    prefix, rest, index = (mtp.group(1), mtp.group(2), ()) if mtp else (LAYERS, split[1], (split[0],))
    if naming.per_layer and not mtp:
        prefix, index = f"{LAYERS}{split[0]}.", ()
    expert = _EXPERT_REST.fullmatch(rest)
    if expert:
        return f"{prefix}mlp.experts.experts.{expert.group(2)}", index + (int(expert.group(1)),)
    return prefix + (_TE_NAMES.get(rest, rest) if naming.te_norms else rest), index


def split_layer_key(key: str) -> Optional[Tuple[Optional[int], str]]:
    """``decoder.layers.N.rest`` -> (N, rest); torch_dist's stacked ``decoder.layers.rest`` ->
    (None, rest); other keys -> None."""
    m = _LAYER_KEY.fullmatch(key)
    return None if m is None else (None if m.group(1) is None else int(m.group(1)), m.group(2))


def split_any_layer(name: str) -> Optional[Tuple[str, str]]:
    """A canonical name of a decoder layer's or an MTP layer's tensor -> (the layer's prefix,
    ``decoder.layers.N.`` or ``mtp.layers.D.transformer_layer.``, and the rest); else None."""
    mtp = MTP_LAYER.fullmatch(name)
    if mtp:
        return mtp.group(1), mtp.group(2)
    split = split_layer_key(name)
    if split is None or split[0] is None:
        return None
    return f"{LAYERS}{split[0]}.", split[1]


def split_local_expert(rest: str) -> Optional[Tuple[int, str]]:
    """A legacy file's expert name -> (local expert index, ``linear_fc1.weight`` etc.):
    SequentialMLP ``mlp.experts.local_experts.E.linear_fc1.weight`` or TEGroupedMLP
    ``mlp.experts.linear_fc1.weightE``."""
    m = _LEGACY_EXPERT.fullmatch(rest)
    if m is None:
        return None
    return (int(m.group(1)), m.group(2)) if m.group(1) is not None else (int(m.group(4)), m.group(3))


# Multi-latent attention's column-parallel projections; the local spec's down-projections too
# (ColumnParallelLinear, gathered after), where Transformer Engine's are whole on every rank.
_LATENT_COLUMNS = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
# MTP's projection of [embedding, hidden] (column-parallel, gathered after)
_COLUMNS = ("linear_qkv", "linear_fc1", "eh_proj", *_LATENT_COLUMNS)


def tp_dim(name: str) -> Optional[int]:
    """The dimension Megatron splits ``name`` over TP (column-parallel 0, row-parallel weight 1)."""
    if name in (WORD_EMBEDDINGS, OUTPUT_LAYER):
        return 0
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    if kind == "softmax_offset":  # one per head: the heads are split over TP
        return 0
    if module in _COLUMNS:
        return 0
    return 1 if module in ("linear_proj", "linear_fc2") and kind == "weight" else None


def is_glu_fc1(name: str) -> bool:
    return name.rpartition(".")[0].endswith("linear_fc1")


def join_tp_shards(name: str, parts: List[torch.Tensor], glu: bool) -> torch.Tensor:
    """The global tensor of TP shards ``parts`` (in TP rank order), joined along Megatron's split
    dim (SwiGLU fc1: the gate halves of every shard, then the up halves); unsplit: the first."""
    dim = tp_dim(name)
    if dim is None:
        return parts[0]
    if glu and is_glu_fc1(name):
        halves = [p.chunk(2) for p in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim)
