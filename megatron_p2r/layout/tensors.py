"""The tensor table: every parameter a rank of a stage holds, without building the model.

Names, local shapes and sharding attributes exactly as ``model.m6.build_model`` creates them
(``tests/layout/test_tensors.py`` and ``tools/plan.py --verify-rank`` compare with meta-device
builds). The ParallelPlan, the checkpoint's tensor table, the offload choice and the planner
read shapes from here, so none of them needs a model to reason about memory or files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_p2r.config import ModelConfig

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"

@dataclass(frozen=True)
class TensorSpec:
    """One parameter of one rank, as ``build_model`` creates it."""

    name: str                       # module path (the global name)
    shape: Tuple[int, ...]          # local shape on this rank
    tp_dim: Optional[int] = None
    expert: bool = False
    shared_name: Optional[str] = None   # the logical tensor this one replicates (tied output layer)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def logical(self) -> str:
        return self.shared_name or self.name

    def global_numel(self, tp: int, ep: int) -> int:
        return self.numel * (tp if self.tp_dim is not None else 1) * (ep if self.expert else 1)


def _norm(prefix: str, m) -> List[TensorSpec]:
    out = [TensorSpec(f"{prefix}.weight", (m.hidden_size,))]
    if m.normalization == "LayerNorm":
        out.append(TensorSpec(f"{prefix}.bias", (m.hidden_size,)))
    return out


def _column(prefix: str, out_features: int, in_features: int, tp: int, bias: bool) -> List[TensorSpec]:
    specs = [TensorSpec(f"{prefix}.weight", (out_features // tp, in_features), tp_dim=0)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", (out_features // tp,), tp_dim=0))
    return specs


def _row(prefix: str, out_features: int, in_features: int, tp: int, bias: bool) -> List[TensorSpec]:
    specs = [TensorSpec(f"{prefix}.weight", (out_features, in_features // tp), tp_dim=1)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", (out_features,)))
    return specs


def layer_tensors(m: ModelConfig, key: int, tp: int, ep: int) -> List[TensorSpec]:
    """The parameters of transformer module ``layers.{key}`` (model/block.py, attention.py,
    mlp.py, moe/router.py, moe/experts.py)."""
    h, bias, p = m.hidden_size, m.add_bias, f"layers.{key}"
    specs = _norm(f"{p}.input_norm", m)
    specs += _column(f"{p}.attention.qkv", 3 * h, h, tp, bias) + _row(f"{p}.attention.proj", h, h, tp, bias)
    specs += _norm(f"{p}.post_attention_norm", m)
    glu = 2 if m.swiglu else 1
    if m.is_moe_layer(key):
        e, f = m.num_experts // ep, m.expert_ffn_size // tp
        x = f"{p}.mlp.experts"
        specs.append(TensorSpec(f"{p}.mlp.router.weight", (m.num_experts, h)))
        specs.append(TensorSpec(f"{x}.weight1", (e, glu * f, h), tp_dim=1, expert=True))
        specs.append(TensorSpec(f"{x}.weight2", (e, h, f), tp_dim=2, expert=True))
        if bias:
            specs.append(TensorSpec(f"{x}.bias1", (e, glu * f), tp_dim=1, expert=True))
            specs.append(TensorSpec(f"{x}.bias2", (e, h), expert=True))
    else:
        specs += _column(f"{p}.mlp.fc1", glu * m.ffn_size, h, tp, bias) + _row(f"{p}.mlp.fc2", h, m.ffn_size, tp, bias)
    return specs


def stage_tensors(m: ModelConfig, tp: int, ep: int, module_keys: Sequence[int], first: bool,
                  last: bool) -> List[TensorSpec]:
    """Every parameter of a stage that builds ``module_keys``, in ``named_parameters`` order."""
    specs: List[TensorSpec] = []
    for key in module_keys:
        specs += layer_tensors(m, key, tp, ep)
    if first:
        specs.append(TensorSpec(WORD_EMBEDDING, (m.padded_vocab_size // tp, m.hidden_size), tp_dim=0))
        if m.position_embedding_type == "learned_absolute":
            specs.append(TensorSpec("embedding.position_embeddings.weight", (m.max_positions, m.hidden_size)))
    if last:
        specs += _norm("final_norm", m)
        tied = not m.untie_embeddings_and_output_weights
        if not (tied and first):
            specs.append(TensorSpec(OUTPUT_WEIGHT, (m.padded_vocab_size // tp, m.hidden_size), tp_dim=0,
                                    shared_name=WORD_EMBEDDING if tied else None))
    return specs
