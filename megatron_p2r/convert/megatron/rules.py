"""Our pieces <- Megatron-LM's canonical tensors (names.py): which tensor each piece is made
from, and the function that makes it; ``to_megatron`` is the inverse (export-megatron).

Megatron's fused ``linear_qkv`` rows are ``[groups, (q x heads/groups, k, v), head_dim]``: one
group per head is exactly our ``attention.qkv`` layout ``[heads, (q, k, v), head_dim]``; under
--group-query-attention our ``attention.query`` ``[heads, head_dim]`` and
``attention.key_value`` ``[groups, (k, v), head_dim]`` are both regrouped from it (query head i
is in group i // (heads/groups) in both).
Multi-latent attention's tensors are ours under Megatron's names, rows unchanged (the
rotary dimensions in interleaved pairs on both sides), and so are the shared experts' (their
``linear_fc1`` a gated MLP's), the shared-expert gate and an MTP depth's tensors (its transformer
layer's as a layer's, under ``mtp.layers.D.transformer_layer.``).
A gated MLP's (SwiGLU, quick-GeGLU) ``linear_fc1`` is [gate; up], ours interleaves the rows
(gate_j, up_j). The vocabulary
matrices keep Megatron's padded rows (zero rows are added when our padding needs more).
``--apply-layernorm-1p`` stores norm weights as gamma - 1; ours hold gamma.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megatron_p2r.convert.hf.rules import merge_glu, merge_heads, resize_rows, split_glu, split_heads
from megatron_p2r.convert.megatron.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    expert_rest,
    layer_name,
)
from megatron_p2r.config import ModelConfig
from megatron_p2r.layout.tensor_specs import HeadRows, attention_rows

_TOP = {
    "embedding.word_embeddings.weight": WORD_EMBEDDINGS,
    "embedding.position_embeddings.weight": POSITION_EMBEDDINGS,
    "final_norm.weight": FINAL_NORM + "weight",
    "final_norm.bias": FINAL_NORM + "bias",
    "output_layer.weight": OUTPUT_LAYER,
}
_LAYER_MODULES = {
    "input_norm": "input_layernorm",
    "attention.qkv": "self_attention.linear_qkv",
    "attention.query": "self_attention.linear_qkv",
    "attention.key_value": "self_attention.linear_qkv",
    "attention.q_layernorm": "self_attention.q_layernorm",
    "attention.k_layernorm": "self_attention.k_layernorm",
    "attention.proj": "self_attention.linear_proj",
    # multi-latent attention (megatron-core's MLASelfAttention)
    "attention.q_proj": "self_attention.linear_q_proj",
    "attention.q_down_proj": "self_attention.linear_q_down_proj",
    "attention.q_up_proj": "self_attention.linear_q_up_proj",
    "attention.kv_down_proj": "self_attention.linear_kv_down_proj",
    "attention.kv_up_proj": "self_attention.linear_kv_up_proj",
    "attention.kv_layernorm": "self_attention.kv_layernorm",
    "post_attention_norm": "pre_mlp_layernorm",
    "mlp.fc1": "mlp.linear_fc1",
    "mlp.fc2": "mlp.linear_fc2",
    "mlp.router": "mlp.router",
    "mlp.shared_experts.fc1": "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.fc2": "mlp.shared_experts.linear_fc2",
    "mlp.shared_experts": "mlp.shared_experts",  # gate_weight
    "attention": "self_attention.core_attention",
}  # attention.softmax_offset: the sinks
_EXPERT_LEAVES = {
    "weight1": "linear_fc1.weight",
    "bias1": "linear_fc1.bias",
    "weight2": "linear_fc2.weight",
    "bias2": "linear_fc2.bias",
}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)")
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias|softmax_offset|gate_weight)")
# an MTP depth's own tensors, and its transformer layer (a layer's pieces under the prefix)
_MTP_OWN = re.compile(r"mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|final_norm)\.weight")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.layer\.(.+)")
_ANY_LAYER = r"(?:layers\.\d+|mtp\.layers\.\d+\.layer)"
_NORM_WEIGHT = re.compile(
    rf"({_ANY_LAYER}\.(input_norm|post_attention_norm|attention\.(?:[qk]|kv)_layernorm)"
    r"|final_norm|mtp\.layers\.\d+\.(?:enorm|hnorm|final_norm))\.weight"
)
_ATTENTION = re.compile(rf"{_ANY_LAYER}\.attention\.(qkv|query|key_value)\.(weight|bias)")
_GLU = re.compile(rf"{_ANY_LAYER}\.mlp\.(fc1\.(weight|bias)|shared_experts\.fc1\.weight|experts\.\d+\.(weight1|bias1))")


def megatron_name(key: str) -> str:
    """The canonical Megatron tensor our piece ``key`` is made from."""
    if key in _TOP:
        return _TOP[key]
    m = _MTP_OWN.fullmatch(key)
    if m:
        return f"mtp.layers.{m.group(1)}.{'final_layernorm' if m.group(2) == 'final_norm' else m.group(2)}.weight"
    m = _MTP_LAYER.fullmatch(key)
    if m:  # Megatron's name of the piece in a layer 0, under the depth's prefix
        inner = megatron_name(f"layers.0.{m.group(2)}")
        return f"mtp.layers.{m.group(1)}.transformer_layer.{inner[len(layer_name(0, '')) :]}"
    m = _EXPERT_KEY.fullmatch(key)
    if m:
        return layer_name(int(m.group(1)), expert_rest(int(m.group(2)), _EXPERT_LEAVES[m.group(3)]))
    m = _LAYER_KEY.fullmatch(key)
    return layer_name(int(m.group(1)), f"{_LAYER_MODULES[m.group(2)]}.{m.group(3)}")


def megatron_shape(key: str, ours: Tuple[int, ...], m: ModelConfig, vocab_rows: int) -> Tuple[int, ...]:
    """The shape of the Megatron tensor our piece ``key`` (of shape ``ours``) is made from, as the
    saved args imply it: ``vocab_rows`` (their padded vocabulary) for the vocabulary matrices,
    Megatron's fused rows for attention, our own shape otherwise. (Computed, not traced on meta
    tensors: meta cat/stack import torch._dynamo, seconds per run.)"""
    if key in _VOCAB:
        return (vocab_rows,) + ours[1:]
    if _ATTENTION.fullmatch(key):
        return ((m.num_attention_heads + 2 * m.query_groups) * m.head_dim,) + ours[1:]
    return ours


def transform(key: str, m: ModelConfig, zero_centered_gamma: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Megatron's global tensor (of ``megatron_shape``) -> our piece ``key``."""
    if key in _VOCAB:
        return lambda w: resize_rows(w, m.padded_vocab_size)
    attention = _ATTENTION.fullmatch(key)
    if attention:
        return _regroup(attention_rows(m)[attention.group(1)], m)
    if m.gated_linear_unit and _GLU.fullmatch(key):
        return lambda w: merge_glu(*w.chunk(2))
    if zero_centered_gamma and _NORM_WEIGHT.fullmatch(key):
        return lambda w: w + 1
    return lambda w: w


def _regroup(ours: HeadRows, m: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Megatron's fused QKV rows -> the rows of one of our attention pieces."""
    theirs = _theirs(m)
    if theirs == ours:
        return lambda w: w
    kinds = list(dict.fromkeys(ours.per_group))

    def regroup(w: torch.Tensor) -> torch.Tensor:
        parts = dict(zip("qkv", split_heads(w, theirs), strict=True))
        return merge_heads([parts[kind] for kind in kinds], ours)

    return regroup


def _theirs(m: ModelConfig) -> HeadRows:
    """Megatron's fused QKV rows: per group, its query heads, then one key and one value head."""
    groups = m.query_groups
    return HeadRows(groups, ("q",) * (m.num_attention_heads // groups) + ("k", "v"), m.head_dim)


Inverse = Tuple[List[str], Callable[[List[torch.Tensor]], torch.Tensor]]


def to_megatron(keys: Sequence[str], m: ModelConfig) -> Dict[str, Inverse]:
    """Canonical Megatron tensor -> (our pieces it is made from, the function that makes it from
    them): the inverse of ``transform`` for a model exported with Megatron's defaults (norm
    weights as gamma, our padded vocabulary)."""
    groups: Dict[str, List[str]] = {}
    for key in keys:
        groups.setdefault(megatron_name(key), []).append(key)
    return {name: (members, _inverse(members, m)) for name, members in groups.items()}


def _inverse(keys: List[str], m: ModelConfig) -> Callable[[List[torch.Tensor]], torch.Tensor]:
    attention = _ATTENTION.fullmatch(keys[0])
    if attention:
        rows = [attention_rows(m)[_ATTENTION.fullmatch(k).group(1)] for k in keys]

        def fuse(pieces: List[torch.Tensor]) -> torch.Tensor:
            parts = {}
            for w, ours in zip(pieces, rows, strict=True):
                parts.update(zip(dict.fromkeys(ours.per_group), split_heads(w, ours), strict=True))
            return merge_heads([parts[kind] for kind in "qkv"], _theirs(m))

        return fuse
    if m.gated_linear_unit and _GLU.fullmatch(keys[0]):
        return lambda pieces: torch.cat(split_glu(pieces[0]))
    return lambda pieces: pieces[0]
