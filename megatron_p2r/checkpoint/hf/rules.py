"""The tensor mapping between our pieces and HF tensors: one ``Rule`` per piece, with pure
functions both ways.

Our fused per-head QKV ``[heads, (q, k, v), head_dim]`` rows <-> GPT2's transposed Conv1D
``c_attn`` ``[h, q|k|v]`` or Llama's ``q_proj/k_proj/v_proj``; our interleaved SwiGLU rows
``(gate_j, up_j)`` <-> ``gate_proj/up_proj`` (Mixtral: ``w1/w3``); GPT2's Conv1D weights are our
Linear weights transposed. Rotary embeddings need no permutation: ours are rotate-half, as HF
Llama's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron_p2r.checkpoint.hf.architecture import GPT2, LLAMA
from megatron_p2r.config import ModelConfig

def split_qkv(w: torch.Tensor, heads: int) -> List[torch.Tensor]:
    """Our fused QKV rows ``[heads, (q, k, v), head_dim]`` (weight or bias) -> [q, k, v], each [h, ...]."""
    per_head = w.unflatten(0, (heads, 3, -1))
    return [per_head[:, j].flatten(0, 1) for j in range(3)]


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    return torch.stack([t.unflatten(0, (heads, -1)) for t in (q, k, v)], dim=1).flatten(0, 2)


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
    (GPT2 biases of a bias-free model), exported as zeros of ``zero_shape``."""

    ours: Optional[str]
    hf: Tuple[str, ...]
    to_hf: Callable[[torch.Tensor], List[torch.Tensor]]
    from_hf: Callable[[List[torch.Tensor]], torch.Tensor]
    zero_shape: Tuple[int, ...] = ()


def _same(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,), lambda w: [w], lambda t: t[0])


def _transposed(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,), lambda w: [w.t()], lambda t: t[0].t())


def _vocab(ours: str, hf: str, hf_rows: int, padded_rows: int) -> Rule:
    return Rule(ours, (hf,), lambda w: [resize_rows(w, hf_rows)], lambda t: resize_rows(t[0], padded_rows))


def _qkv(ours: str, hf: Sequence[str], heads: int) -> Rule:
    return Rule(ours, tuple(hf), lambda w: split_qkv(w, heads), lambda t: merge_qkv(*t, heads))


def _glu(ours: str, gate: str, up: str) -> Rule:
    return Rule(ours, (gate, up), split_glu, lambda t: merge_glu(*t))


def rules(m: ModelConfig, arch: str, hf_vocab: int) -> List[Rule]:
    """Every piece of the real model ``m`` and the HF tensors it maps to, in model order."""
    heads, h = m.num_attention_heads, m.hidden_size
    tied = not m.untie_embeddings_and_output_weights
    out: List[Rule] = []
    if arch == GPT2:
        p = "transformer."
        out += [_vocab("embedding.word_embeddings.weight", p + "wte.weight", hf_vocab, m.padded_vocab_size),
                _same("embedding.position_embeddings.weight", p + "wpe.weight")]
        for i in range(m.num_layers):
            o, t = f"layers.{i}.", f"{p}h.{i}."
            out += [_same(o + "input_norm.weight", t + "ln_1.weight"), _same(o + "input_norm.bias", t + "ln_1.bias"),
                    Rule(o + "attention.qkv.weight", (t + "attn.c_attn.weight",),
                         lambda w: [torch.cat(split_qkv(w, heads)).t()],
                         lambda x: merge_qkv(*x[0].t().chunk(3), heads)),
                    _transposed(o + "attention.proj.weight", t + "attn.c_proj.weight"),
                    _same(o + "post_attention_norm.weight", t + "ln_2.weight"),
                    _same(o + "post_attention_norm.bias", t + "ln_2.bias"),
                    _transposed(o + "mlp.fc1.weight", t + "mlp.c_fc.weight"),
                    _transposed(o + "mlp.fc2.weight", t + "mlp.c_proj.weight")]
            biases = [(o + "attention.qkv.bias", t + "attn.c_attn.bias", 3 * h),
                      (o + "attention.proj.bias", t + "attn.c_proj.bias", h),
                      (o + "mlp.fc1.bias", t + "mlp.c_fc.bias", m.ffn_size),
                      (o + "mlp.fc2.bias", t + "mlp.c_proj.bias", h)]
            for ours, hf, size in biases:
                if not m.add_bias:  # GPT2 always has biases: a bias-free model exports zeros
                    out.append(Rule(None, (hf,), None, None, (size,)))
                elif ours.endswith("qkv.bias"):
                    out.append(Rule(ours, (hf,), lambda b: [torch.cat(split_qkv(b, heads))],
                                    lambda x: merge_qkv(*x[0].chunk(3), heads)))
                else:
                    out.append(_same(ours, hf))
        out += [_same("final_norm.weight", p + "ln_f.weight"), _same("final_norm.bias", p + "ln_f.bias")]
    else:
        p = "model."
        out.append(_vocab("embedding.word_embeddings.weight", p + "embed_tokens.weight", hf_vocab,
                          m.padded_vocab_size))
        for i in range(m.num_layers):
            o, t = f"layers.{i}.", f"{p}layers.{i}."
            a = t + "self_attn."
            out += [_same(o + "input_norm.weight", t + "input_layernorm.weight"),
                    _qkv(o + "attention.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                         heads),
                    _same(o + "attention.proj.weight", a + "o_proj.weight")]
            if m.add_bias:
                out += [_qkv(o + "attention.qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                             heads),
                        _same(o + "attention.proj.bias", a + "o_proj.bias")]
            out.append(_same(o + "post_attention_norm.weight", t + "post_attention_layernorm.weight"))
            if arch == LLAMA:
                out += [_glu(o + "mlp.fc1.weight", t + "mlp.gate_proj.weight", t + "mlp.up_proj.weight"),
                        _same(o + "mlp.fc2.weight", t + "mlp.down_proj.weight")]
                if m.add_bias:
                    out += [_glu(o + "mlp.fc1.bias", t + "mlp.gate_proj.bias", t + "mlp.up_proj.bias"),
                            _same(o + "mlp.fc2.bias", t + "mlp.down_proj.bias")]
            else:
                moe = t + "block_sparse_moe."
                out.append(_same(o + "mlp.router.weight", moe + "gate.weight"))
                for e in range(m.num_experts):
                    x = f"{moe}experts.{e}."
                    out += [_glu(f"{o}mlp.experts.{e}.weight1", x + "w1.weight", x + "w3.weight"),
                            _same(f"{o}mlp.experts.{e}.weight2", x + "w2.weight")]
        out.append(_same("final_norm.weight", p + "norm.weight"))
    if not tied:
        out.append(_vocab("output_layer.weight", "lm_head.weight", hf_vocab, m.padded_vocab_size))
    return out
