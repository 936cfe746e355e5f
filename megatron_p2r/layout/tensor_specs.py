"""Tensor specs: every parameter a rank of a stage holds (local shape, sharding, module), without
building the model.

Names, local shapes and sharding attributes exactly as ``model.m6.build_model`` creates them
(``tests/layout/test_plan.py``, ``tests/layout/test_tensor_specs.py`` and ``tools/plan.py
--verify-rank`` compare with meta-device builds). The ParallelPlan, the checkpoint's tensor table
(global pieces and the files holding them), the offload choice and the planner read shapes from
here, so none of them needs a model to reason about memory or files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.config import ModelConfig

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
EMBEDDING_REPLICA = "embedding_replica.weight"
# Parameters a sequence-parallel rank applies to its sequence shard only, so each TP rank holds a
# partial gradient (model/block.py, attention.py's and mlp.py's row-parallel biases,
# moe/router.py, m6.py's embedding).
SEQUENCE_PARALLEL_PARTIAL = (
    "input_norm.weight",
    "input_norm.bias",
    "post_attention_norm.weight",
    "post_attention_norm.bias",
    "final_norm.weight",
    "final_norm.bias",
    "attention_output_norm.weight",
    "attention_output_norm.bias",
    "mlp_output_norm.weight",
    "mlp_output_norm.bias",
    "attention.proj.bias",
    # multi-latent attention's replicated down-projections and latent norms (model/latent_attention.py)
    "attention.q_down_proj.weight",
    "attention.kv_down_proj.weight",
    "attention.q_layernorm.weight",
    "attention.q_layernorm.bias",
    "attention.kv_layernorm.weight",
    "attention.kv_layernorm.bias",
    "mlp.fc2.bias",
    "mlp.router.weight",
    "mlp.router.bias",
    "mlp.shared_experts.gate_weight",
    "embedding.position_embeddings.weight",
    "enorm.weight",
    "enorm.bias",
    "hnorm.weight",
    "hnorm.bias",
)


@dataclass(frozen=True)
class HeadRows:
    """The layout of dim 0 of an attention projection (weight or bias): ``groups`` blocks, each
    the heads ``per_group`` names in order, each head ``head_dim`` rows.

    ``attention.qkv`` (no --group-query-attention): heads x (q, k, v) — Megatron-LM's fused
    ``linear_qkv`` with one group per head. Under --group-query-attention: ``attention.query``,
    heads x (q,), and ``attention.key_value``, groups x (k, v). A TP split cuts whole blocks:
    ``min(TP, groups)`` distinct shards; with TP > groups, TP/groups consecutive ranks hold
    the same block (replicas of a key/value head).
    """

    groups: int
    per_group: Tuple[str, ...]
    head_dim: int

    def tp_shards(self, tp: int) -> int:
        return min(tp, self.groups)

    def tp_replicas(self, tp: int) -> int:
        return tp // self.tp_shards(tp)

    def to_json(self) -> dict:
        return {"groups": self.groups, "per_group": list(self.per_group), "head_dim": self.head_dim}

    @classmethod
    def from_json(cls, d: dict) -> "HeadRows":
        return cls(
            groups=int(d["groups"]), per_group=tuple(str(x) for x in d["per_group"]), head_dim=int(d["head_dim"])
        )


def attention_rows(m: ModelConfig) -> Dict[str, HeadRows]:
    """Module name under ``attention.`` -> the row layout of its weight and bias (none under
    --multi-latent-attention: its up-projections split by plain row blocks, whole heads)."""
    if m.multi_latent_attention:
        return {}
    d = m.head_dim
    if not m.group_query_attention:
        return {"qkv": HeadRows(m.num_attention_heads, ("q", "k", "v"), d)}
    return {"query": HeadRows(m.num_attention_heads, ("q",), d), "key_value": HeadRows(m.query_groups, ("k", "v"), d)}


@dataclass(frozen=True)
class TensorSpec:
    """One parameter of one rank, as ``build_model`` creates it."""

    name: str  # module path (the global name)
    shape: Tuple[int, ...]  # local shape on this rank
    tp_dim: Optional[int] = None
    expert: bool = False
    shared_name: Optional[str] = None  # the logical tensor this one replicates (tied output layer)
    tp_replicas: int = 1  # consecutive TP ranks holding the same shard (key/value heads, TP > groups)
    tp_partial: bool = False  # each TP copy gets a partial gradient, summed over the copies (plan.py)
    rows: Optional[HeadRows] = None  # dim 0 of an attention projection
    module_key: Optional[int] = None  # K of a parameter of transformer module ``layers.K`` (else None)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def logical(self) -> str:
        return self.shared_name or self.name

    def global_numel(self, tp: int, ep: int) -> int:
        return self.numel * (tp // self.tp_replicas if self.tp_dim is not None else 1) * (ep if self.expert else 1)

    def tp_sum_block(self, tp: int) -> int:
        """Consecutive TP ranks whose gradients of this tensor are partial and summed (1: none)."""
        if not self.tp_partial:
            return 1
        return tp if self.tp_dim is None else self.tp_replicas


def _norm(prefix: str, m, size: Optional[int] = None, tp_partial: bool = False) -> List[TensorSpec]:
    size = size or m.hidden_size
    out = [TensorSpec(f"{prefix}.weight", (size,), tp_partial=tp_partial)]
    if m.normalization == "LayerNorm":
        out.append(TensorSpec(f"{prefix}.bias", (size,), tp_partial=tp_partial))
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


def _heads(prefix: str, rows: HeadRows, in_features: int, tp: int, bias: bool) -> List[TensorSpec]:
    """A column-parallel projection onto heads: whole row blocks per TP shard; key/value heads
    replicated (with partial gradients) when TP exceeds their number."""
    local = rows.groups * len(rows.per_group) * rows.head_dim // rows.tp_shards(tp)
    common = dict(tp_dim=0, tp_replicas=rows.tp_replicas(tp), tp_partial=rows.tp_replicas(tp) > 1, rows=rows)
    specs = [TensorSpec(f"{prefix}.weight", (local, in_features), **common)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", (local,), **common))
    return specs


def latent_attention_tensors(m: ModelConfig, prefix: str, tp: int) -> List[TensorSpec]:
    """The parameters of one ``model/latent_attention.py`` module: down-projections and latent norms
    whole on every TP rank (their gradients are whole too, but partial under sequence
    parallelism), up-projections column-parallel over heads, the output row-parallel."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.q_lora_rank is None:
        specs = _column(f"{prefix}.q_proj", heads * m.q_head_dim, h, tp, False)
    else:
        specs = [TensorSpec(f"{prefix}.q_down_proj.weight", (m.q_lora_rank, h))]
        if m.qk_layernorm:
            specs += _norm(f"{prefix}.q_layernorm", m, m.q_lora_rank)
        specs += _column(f"{prefix}.q_up_proj", heads * m.q_head_dim, m.q_lora_rank, tp, False)
    specs.append(TensorSpec(f"{prefix}.kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_emb_head_dim, h)))
    if m.qk_layernorm:
        specs += _norm(f"{prefix}.kv_layernorm", m, m.kv_lora_rank)
    specs += _column(f"{prefix}.kv_up_proj", heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, tp, False)
    return specs + _row(f"{prefix}.proj", h, heads * m.v_head_dim, tp, m.add_bias)


def attention_tensors(m: ModelConfig, prefix: str, tp: int) -> List[TensorSpec]:
    """The parameters of one ``model/attention.py`` (or ``model/latent_attention.py``) module."""
    if m.multi_latent_attention:
        return latent_attention_tensors(m, prefix, tp)
    h = m.hidden_size
    specs: List[TensorSpec] = []
    if m.softmax_type == "learnable":  # the module's own parameter comes before its submodules'
        specs.append(TensorSpec(f"{prefix}.softmax_offset", (m.num_attention_heads // tp,), tp_dim=0))
    for name, rows in attention_rows(m).items():
        specs += _heads(f"{prefix}.{name}", rows, h, tp, m.qkv_bias)
    if m.qk_layernorm and m.qk_layernorm_over_heads:  # a weight per row, split as the heads
        for name, rows in (
            ("q_layernorm", HeadRows(m.num_attention_heads, ("q",), m.head_dim)),
            ("k_layernorm", HeadRows(m.query_groups, ("k",), m.head_dim)),
        ):
            replicas = rows.tp_replicas(tp)
            local = rows.groups * rows.head_dim // rows.tp_shards(tp)
            specs.append(
                TensorSpec(
                    f"{prefix}.{name}.weight",
                    (local,),
                    tp_dim=0,
                    tp_replicas=replicas,
                    tp_partial=replicas > 1,
                    rows=rows,
                )
            )
    elif m.qk_layernorm:  # one norm over head_dim, applied to each rank's own heads: partial gradients
        specs += _norm(f"{prefix}.q_layernorm", m, m.head_dim, tp_partial=True)
        specs += _norm(f"{prefix}.k_layernorm", m, m.head_dim, tp_partial=True)
    return specs + _row(f"{prefix}.proj", h, m.num_attention_heads * m.head_dim, tp, m.add_bias)


def layer_tensors(m: ModelConfig, key: int, tp: int, ep: int) -> List[TensorSpec]:
    """The parameters of transformer module ``layers.{key}`` (model/block.py, attention.py,
    mlp.py, moe/router.py, moe/experts.py; a MoE layer's shared experts: model/mlp.py)."""
    h, bias, p = m.hidden_size, m.add_bias, f"layers.{key}"
    specs = _norm(f"{p}.input_norm", m) if m.input_norms else []
    specs += attention_tensors(m, f"{p}.attention", tp)
    specs += _norm(f"{p}.post_attention_norm", m) if m.input_norms else []
    glu = 2 if m.gated_linear_unit else 1
    if m.is_moe_layer(key):
        e, f = m.num_experts // ep, m.expert_ffn_size // tp
        x = f"{p}.mlp.experts"
        specs.append(TensorSpec(f"{p}.mlp.router.weight", (m.num_experts, h)))
        if m.router_bias:  # moe/router.py's bias on the logits (megatron-core's under --add-bias-linear)
            specs.append(TensorSpec(f"{p}.mlp.router.bias", (m.num_experts,)))
        specs.append(TensorSpec(f"{x}.weight1", (e, glu * f, h), tp_dim=1, expert=True))
        specs.append(TensorSpec(f"{x}.weight2", (e, h, f), tp_dim=2, expert=True))
        if bias:
            specs.append(TensorSpec(f"{x}.bias1", (e, glu * f), tp_dim=1, expert=True))
            specs.append(TensorSpec(f"{x}.bias2", (e, h), expert=True))
        if m.shared_expert_ffn_size:  # model/mlp.py's SharedExperts: a dense MLP without biases
            s, f = f"{p}.mlp.shared_experts", m.shared_expert_ffn_size
            if m.moe_shared_expert_gate:  # the module's own parameter: before its linears'
                specs.append(TensorSpec(f"{s}.gate_weight", (1, h)))
            specs += _column(f"{s}.fc1", glu * f, h, tp, False) + _row(f"{s}.fc2", h, f, tp, False)
    else:
        specs += _column(f"{p}.mlp.fc1", glu * m.ffn_size, h, tp, bias) + _row(f"{p}.mlp.fc2", h, m.ffn_size, tp, bias)
    if m.output_norms:
        specs += _norm(f"{p}.attention_output_norm", m) + _norm(f"{p}.mlp_output_norm", m)
    return [dataclasses.replace(s, module_key=key) for s in specs]


def stage_tensors(
    m: ModelConfig,
    tp: int,
    ep: int,
    module_keys: Sequence[int],
    first: bool,
    last: bool,
    sequence_parallel: bool = False,
) -> List[TensorSpec]:
    """Every parameter of a stage that builds ``module_keys``, in ``named_parameters`` order;
    under ``sequence_parallel`` those applied to sequence shards hold partial gradients."""
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
            specs.append(
                TensorSpec(
                    OUTPUT_WEIGHT,
                    (m.padded_vocab_size // tp, m.hidden_size),
                    tp_dim=0,
                    shared_name=WORD_EMBEDDING if tied else None,
                )
            )
    if holds_embedding_replica(m, first, last):
        specs.append(
            TensorSpec(
                EMBEDDING_REPLICA, (m.padded_vocab_size // tp, m.hidden_size), tp_dim=0, shared_name=WORD_EMBEDDING
            )
        )
    if last and m.mtp_num_layers:
        specs += mtp_tensors(m, tp, ep)
    if sequence_parallel:
        specs = [
            dataclasses.replace(s, tp_partial=True) if s.name.endswith(SEQUENCE_PARALLEL_PARTIAL) else s for s in specs
        ]
    return specs


def holds_embedding_replica(m: ModelConfig, first: bool, last: bool) -> bool:
    """Whether a stage holds ``EMBEDDING_REPLICA``: the last stage, when it is not the first, runs
    multi-token prediction with untied weights and so looks tokens up in a replica of the input
    embedding (as Megatron-LM builds the embedding on its MTP stage); tied, the output layer is
    that replica already."""
    return last and not first and bool(m.mtp_num_layers) and m.untie_embeddings_and_output_weights


def mtp_tensors(m: ModelConfig, tp: int, ep: int) -> List[TensorSpec]:
    """The parameters of ``model/mtp.py``'s depths (the last stage's): two norms, the
    column-parallel 2h -> h projection, a transformer layer of the last layer's kind (its names
    under ``.layer``, part of no layer module: not shared, ``module_key`` None), a final norm."""
    last = m.num_layers - 1
    specs: List[TensorSpec] = []
    for depth in range(m.mtp_num_layers):
        p = f"mtp.layers.{depth}"
        specs += _norm(f"{p}.enorm", m) + _norm(f"{p}.hnorm", m)
        specs += _column(f"{p}.eh_proj", m.hidden_size, 2 * m.hidden_size, tp, bias=False)
        specs += [
            dataclasses.replace(s, name=f"{p}.layer." + s.name.split(".", 2)[2], module_key=None)
            for s in layer_tensors(m, last, tp, ep)
        ]
        specs += _norm(f"{p}.final_norm", m)
    return specs
