"""The tensor mapping between our pieces and HF tensors: one ``Rule`` per piece, with pure
functions both ways.

Our attention rows, laid out as the checkpoint's ``HeadRows`` say (fused ``[heads, (q, k, v),
head_dim]``, or under --group-query-attention ``query`` ``[heads, head_dim]`` and
``key_value`` ``[groups, (k, v), head_dim]``) <-> GPT2's transposed Conv1D ``c_attn``
``[h, q|k|v]`` or ``q_proj/k_proj/v_proj`` (Llama, Mistral, Mixtral, Qwen2: head i of q uses
key/value head i // (heads/groups), as ours); our interleaved SwiGLU rows ``(gate_j, up_j)``
<-> ``gate_proj/up_proj`` (Mixtral: ``w1/w3``); GPT2's Conv1D weights are our Linear weights
transposed. Rotary embeddings need no permutation: ours are rotate-half, as HF Llama's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron_p2r.checkpoint.expert_bias import bias_name, mtp_bias_name
from megatron_p2r.convert.hf.architecture import (
    DEEPSEEK_V3,
    GEMMAS,
    GPT2,
    GPT_OSS,
    GRANITE_MOE,
    MIXTRAL,
    OLMO2,
    QWEN3_MOE,
)
from megatron_p2r.config import ModelConfig
from megatron_p2r.layout.tensor_specs import HeadRows, attention_rows


def _indices(rows: HeadRows) -> dict:
    """head kind -> its positions inside a group, kinds in order of first appearance (q, k, v)."""
    out: dict = {}
    for i, kind in enumerate(rows.per_group):
        out.setdefault(kind, []).append(i)
    return out


def split_heads(w: torch.Tensor, rows: HeadRows) -> List[torch.Tensor]:
    """Rows laid out as ``rows`` (weight or bias) -> one tensor per head kind (q, k, v), each
    its heads in order, ``[heads of that kind x head_dim, ...]``."""
    blocks = w.unflatten(0, (rows.groups, len(rows.per_group), rows.head_dim))
    return [blocks[:, idx].flatten(0, 2) for idx in _indices(rows).values()]


def merge_heads(parts: Sequence[torch.Tensor], rows: HeadRows) -> torch.Tensor:
    """The inverse of ``split_heads``."""
    blocks: List[Optional[torch.Tensor]] = [None] * len(rows.per_group)
    for part, idx in zip(parts, _indices(rows).values(), strict=True):
        heads = part.unflatten(0, (rows.groups, len(idx), rows.head_dim))
        for j, i in enumerate(idx):
            blocks[i] = heads[:, j]
    return torch.stack(blocks, dim=1).flatten(0, 2)


def split_glu(w: torch.Tensor) -> List[torch.Tensor]:
    """Our interleaved SwiGLU rows ``(gate_j, up_j)`` -> [gate, up]."""
    return [w[0::2], w[1::2]]


def merge_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def resize_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut a vocabulary matrix to ``rows``, or pad it with zero rows."""
    if w.shape[0] >= rows:
        return w[:rows]
    return torch.cat([w, w.new_zeros((rows - w.shape[0],) + tuple(w.shape[1:]))])


@dataclasses.dataclass(frozen=True)
class Rule:
    """One piece of ours <-> the HF tensors it becomes. ``ours`` None: an HF tensor we do not have
    (GPT2 biases of a bias-free model), exported as zeros of ``zero_shape``; or, with ``stack``,
    experts whose HF tensors hold them all (Granite): ``stack`` names our pieces, one per expert,
    each mapped by ``to_hf``/``from_hf``, stacked along a new first dimension of every HF tensor.
    ``kind`` ``copy``: a second HF copy of a piece another rule maps (DeepSeek's prediction layers
    repeat the embedding and the output head; import requires them equal); ``expert_bias``: ours
    names a router's bias in metadata.json (``checkpoint/expert_bias.py``), not a piece, of
    ``zero_shape``. Import requires a ``None`` rule's HF tensor to be zeros."""

    ours: Optional[str]
    hf: Tuple[str, ...]
    to_hf: Callable[[torch.Tensor], List[torch.Tensor]]
    from_hf: Callable[[List[torch.Tensor]], torch.Tensor]
    zero_shape: Tuple[int, ...] = ()
    stack: Tuple[str, ...] = ()
    kind: str = "piece"

    @property
    def pieces(self) -> Tuple[str, ...]:
        """Our pieces this rule maps (none for a copy or an expert bias)."""
        if self.kind != "piece":
            return ()
        return self.stack or ((self.ours,) if self.ours else ())


def _same(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,), lambda w: [w], lambda t: t[0])


def _transposed(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,), lambda w: [w.t()], lambda t: t[0].t())


def _vocab(ours: str, hf: str, hf_rows: int, padded_rows: int) -> Rule:
    return Rule(ours, (hf,), lambda w: [resize_rows(w, hf_rows)], lambda t: resize_rows(t[0], padded_rows))


def _heads(ours: str, hf: Sequence[str], rows: HeadRows) -> Rule:
    return Rule(ours, tuple(hf), lambda w: split_heads(w, rows), lambda t: merge_heads(t, rows))


def _glu(ours: str, gate: str, up: str) -> Rule:
    return Rule(ours, (gate, up), split_glu, lambda t: merge_glu(*t))


def _gpt2_layer(m: ModelConfig, o: str, t: str) -> List[Rule]:
    rows = attention_rows(m)["qkv"]
    out = [
        _same(o + "input_norm.weight", t + "ln_1.weight"),
        _same(o + "input_norm.bias", t + "ln_1.bias"),
        Rule(
            o + "attention.qkv.weight",
            (t + "attn.c_attn.weight",),
            lambda w: [torch.cat(split_heads(w, rows)).t()],
            lambda x: merge_heads(x[0].t().chunk(3), rows),
        ),
        _transposed(o + "attention.proj.weight", t + "attn.c_proj.weight"),
        _same(o + "post_attention_norm.weight", t + "ln_2.weight"),
        _same(o + "post_attention_norm.bias", t + "ln_2.bias"),
        _transposed(o + "mlp.fc1.weight", t + "mlp.c_fc.weight"),
        _transposed(o + "mlp.fc2.weight", t + "mlp.c_proj.weight"),
    ]
    h = m.hidden_size
    if m.qkv_bias:
        out.append(
            Rule(
                o + "attention.qkv.bias",
                (t + "attn.c_attn.bias",),
                lambda b: [torch.cat(split_heads(b, rows))],
                lambda x: merge_heads(x[0].chunk(3), rows),
            )
        )
    else:  # GPT2 always has biases: a bias-free model exports zeros
        out.append(Rule(None, (t + "attn.c_attn.bias",), None, None, (3 * h,)))
    for ours, hf, size in [
        (o + "attention.proj.bias", t + "attn.c_proj.bias", h),
        (o + "mlp.fc1.bias", t + "mlp.c_fc.bias", m.ffn_size),
        (o + "mlp.fc2.bias", t + "mlp.c_proj.bias", h),
    ]:
        out.append(_same(ours, hf) if m.add_bias else Rule(None, (hf,), None, None, (size,)))
    return out


def _attention(m: ModelConfig, o: str, a: str) -> List[Rule]:
    """Our query/key/value rows <-> q_proj, k_proj, v_proj; the output projection <-> o_proj."""
    proj = {"q": a + "q_proj", "k": a + "k_proj", "v": a + "v_proj"}
    out = []
    for name, rows in attention_rows(m).items():
        for leaf in ("weight", "bias") if m.qkv_bias else ("weight",):
            out.append(_heads(f"{o}attention.{name}.{leaf}", [f"{proj[k]}.{leaf}" for k in _indices(rows)], rows))
    out.append(_same(o + "attention.proj.weight", a + "o_proj.weight"))
    if m.add_bias:
        out.append(_same(o + "attention.proj.bias", a + "o_proj.bias"))
    if m.qk_layernorm:  # Qwen3: RMSNorm over each head's dimensions; OLMo 2: over all heads
        out += [
            _same(o + "attention.q_layernorm.weight", a + "q_norm.weight"),
            _same(o + "attention.k_layernorm.weight", a + "k_norm.weight"),
        ]
    return out


def _latent_attention(m: ModelConfig, o: str, a: str) -> List[Rule]:
    """DeepSeek-V3's projections are ours under other names, rows in the same order (the rotary
    dimensions in DeepSeek's interleaved pairs on both sides: megatron-core's layout)."""
    names = {
        "kv_down_proj": "kv_a_proj_with_mqa",
        "kv_layernorm": "kv_a_layernorm",
        "kv_up_proj": "kv_b_proj",
        "proj": "o_proj",
        **(
            {"q_proj": "q_proj"}
            if m.q_lora_rank is None
            else {"q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "q_up_proj": "q_b_proj"}
        ),
    }
    return [_same(f"{o}attention.{ours}.weight", f"{a}{hf}.weight") for ours, hf in names.items()]


# Each MoE architecture's names: (block, router, expert's gate, up, down)
EXPERT_NAMES = {
    MIXTRAL: ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
    QWEN3_MOE: ("mlp.", "gate", "gate_proj", "up_proj", "down_proj"),
    DEEPSEEK_V3: ("mlp.", "gate", "gate_proj", "up_proj", "down_proj"),
}


def _deepseek_moe(m: ModelConfig, o: str, x: str, bias_key: Optional[str]) -> List[Rule]:
    """DeepSeek's shared experts and the router's e_score_correction_bias: the expert bias
    ``bias_key`` in metadata.json (a decoder layer's or a prediction depth's router), or zeros."""
    bias = x + "gate.e_score_correction_bias"
    return [
        _glu(
            o + "mlp.shared_experts.fc1.weight",
            x + "shared_experts.gate_proj.weight",
            x + "shared_experts.up_proj.weight",
        ),
        _same(o + "mlp.shared_experts.fc2.weight", x + "shared_experts.down_proj.weight"),
        Rule(bias_key, (bias,), lambda w: [w], lambda t: t[0], (m.num_experts,), kind="expert_bias")
        if bias_key
        else Rule(None, (bias,), None, None, (m.num_experts,)),
    ]


def _granite_experts(m: ModelConfig, o: str, moe: str) -> List[Rule]:
    """Granite's experts stacked: input_linear ``[E, (gate | up), h]`` (the gate rows first, then
    the up rows), output_linear ``[E, h, ffn]``; its router ``router.layer``."""
    keys = [f"{o}mlp.experts.{e}." for e in range(m.num_experts)]
    return [
        _same(o + "mlp.router.weight", moe + "router.layer.weight"),
        Rule(
            None,
            (moe + "input_linear.weight",),
            lambda w: [torch.cat(split_glu(w))],
            lambda t: merge_glu(*t[0].chunk(2)),
            stack=tuple(k + "weight1" for k in keys),
        ),
        Rule(
            None,
            (moe + "output_linear.weight",),
            lambda w: [w],
            lambda t: t[0],
            stack=tuple(k + "weight2" for k in keys),
        ),
    ]


def _gpt_oss_experts(m: ModelConfig, o: str, moe: str) -> List[Rule]:
    """gpt-oss's router with its bias, and its experts stacked and transposed: gate_up_proj
    ``[E, h, 2 ffn]`` whose columns interleave (gate_j, up_j) as our rows do, down_proj
    ``[E, ffn, h]``, their biases ``[E, 2 ffn]`` and ``[E, h]``."""
    keys = [f"{o}mlp.experts.{e}." for e in range(m.num_experts)]
    out = [_same(o + "mlp.router.weight", moe + "router.weight"), _same(o + "mlp.router.bias", moe + "router.bias")]
    for ours, theirs, transposed in (
        ("weight1", "gate_up_proj", True),
        ("bias1", "gate_up_proj_bias", False),
        ("weight2", "down_proj", True),
        ("bias2", "down_proj_bias", False),
    ):
        rule = _transposed(None, moe + "experts." + theirs) if transposed else _same(None, moe + "experts." + theirs)
        out.append(dataclasses.replace(rule, stack=tuple(k + ours for k in keys)))
    return out


# Each architecture's layer norms: ours -> its (OLMo 2's post_attention_layernorm is on attention's output)
GEMMA_NORM_NAMES = {
    "input_norm": "input_layernorm",
    "attention_output_norm": "post_attention_layernorm",
    "post_attention_norm": "pre_feedforward_layernorm",
    "mlp_output_norm": "post_feedforward_layernorm",
}
LAYER_NORM_NAMES = {
    OLMO2: {"attention_output_norm": "post_attention_layernorm", "mlp_output_norm": "post_feedforward_layernorm"},
    **{arch: GEMMA_NORM_NAMES for arch in GEMMAS},
}


def _one_plus(r: Rule) -> Rule:
    """Gemma's RMSNorm weights: HF stores w and multiplies by (1 + w) in fp32; ours store 1 + w
    (computed in fp32 as transformers does, so our weight is bitwise its factor), exported as
    ours - 1, whose 1 + w is ours again (bitwise for weights >= 0.5, where ours - 1 is exact)."""
    return Rule(r.ours, r.hf, lambda w: [w - 1.0], lambda t: 1.0 + t[0].float())


PRE_NORM_NAMES = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}


def _rotary_layer(m: ModelConfig, arch: str, o: str, t: str, moe: bool, bias_key: Optional[str] = None) -> List[Rule]:
    norms = LAYER_NORM_NAMES.get(arch, PRE_NORM_NAMES).items()
    out = [_same(f"{o}{ours}.weight", f"{t}{theirs}.weight") for ours, theirs in norms]
    out += (_latent_attention if arch == DEEPSEEK_V3 else _attention)(m, o, t + "self_attn.")
    if arch == GPT_OSS:  # learned sinks, [heads] as our softmax offsets
        return out + [_same(o + "attention.softmax_offset", t + "self_attn.sinks")] + _gpt_oss_experts(m, o, t + "mlp.")
    if not moe:
        out += [
            _glu(o + "mlp.fc1.weight", t + "mlp.gate_proj.weight", t + "mlp.up_proj.weight"),
            _same(o + "mlp.fc2.weight", t + "mlp.down_proj.weight"),
        ]
        if m.add_bias:
            out += [
                _glu(o + "mlp.fc1.bias", t + "mlp.gate_proj.bias", t + "mlp.up_proj.bias"),
                _same(o + "mlp.fc2.bias", t + "mlp.down_proj.bias"),
            ]
        return out
    if arch == GRANITE_MOE:
        return out + _granite_experts(m, o, t + "block_sparse_moe.")
    block, router, gate, up, down = EXPERT_NAMES[arch]
    out.append(_same(o + "mlp.router.weight", f"{t}{block}{router}.weight"))
    for e in range(m.num_experts):
        x = f"{t}{block}experts.{e}."
        out += [
            _glu(f"{o}mlp.experts.{e}.weight1", f"{x}{gate}.weight", f"{x}{up}.weight"),
            _same(f"{o}mlp.experts.{e}.weight2", f"{x}{down}.weight"),
        ]
    if arch == DEEPSEEK_V3:
        out += _deepseek_moe(m, o, t + block, bias_key)
    return out


def _prediction_layers(m: ModelConfig, hf_vocab: int) -> List[Rule]:
    """Our multi-token prediction depths as DeepSeek's files hold them: depth d is decoder layer
    ``num_layers + d`` with its own copies of the embedding and the output head, ``enorm``,
    ``hnorm``, ``eh_proj`` (ours: [embedding, hidden] columns, as vLLM reads it), the layer, and
    ``shared_head.norm`` (our depth's final norm)."""
    head = "output_layer.weight" if m.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    out: List[Rule] = []
    for d in range(m.mtp_num_layers or 0):
        o, t = f"mtp.layers.{d}.", f"model.layers.{m.num_layers + d}."
        copies = [
            ("embedding.word_embeddings.weight", t + "embed_tokens.weight"),
            (head, t + "shared_head.head.weight"),
        ]
        out += [
            dataclasses.replace(_vocab(ours, hf, hf_vocab, m.padded_vocab_size), kind="copy") for ours, hf in copies
        ]
        out += [_same(f"{o}{name}.weight", f"{t}{name}.weight") for name in ("enorm", "hnorm", "eh_proj")]
        out += _rotary_layer(m, DEEPSEEK_V3, o + "layer.", t, m.is_moe_layer(m.num_layers - 1), mtp_bias_name(d))
        out.append(_same(o + "final_norm.weight", t + "shared_head.norm.weight"))
    return out


def rules(m: ModelConfig, arch: str, hf_vocab: int) -> List[Rule]:
    """Every piece of the real model ``m`` and the HF tensors it maps to, in model order."""
    out: List[Rule] = []
    if arch == GPT2:
        p = "transformer."
        out += [
            _vocab("embedding.word_embeddings.weight", p + "wte.weight", hf_vocab, m.padded_vocab_size),
            _same("embedding.position_embeddings.weight", p + "wpe.weight"),
        ]
        for i in range(m.num_layers):
            out += _gpt2_layer(m, f"layers.{i}.", f"{p}h.{i}.")
        out += [_same("final_norm.weight", p + "ln_f.weight"), _same("final_norm.bias", p + "ln_f.bias")]
    else:
        p = "model."
        out.append(_vocab("embedding.word_embeddings.weight", p + "embed_tokens.weight", hf_vocab, m.padded_vocab_size))
        for i in range(m.num_layers):
            out += _rotary_layer(m, arch, f"layers.{i}.", f"{p}layers.{i}.", m.is_moe_layer(i), bias_name(i))
        out.append(_same("final_norm.weight", p + "norm.weight"))
        out += _prediction_layers(m, hf_vocab) if arch == DEEPSEEK_V3 else []
    if arch in GEMMAS:  # every norm weight (the layers', the q/k norms', the final one) is 1 + w
        out = [_one_plus(r) if r.ours is not None and r.ours.endswith("norm.weight") else r for r in out]
    if not m.untie_embeddings_and_output_weights:
        return out
    return out + [_vocab("output_layer.weight", "lm_head.weight", hf_vocab, m.padded_vocab_size)]
