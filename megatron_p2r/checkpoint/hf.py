"""Export our checkpoints to Hugging Face transformers, and import HF models back.

Which HF architecture a model becomes is decided by its options (``hf_architecture``):

    learned positions, LayerNorm, GELU, dense         -> GPT2LMHeadModel
    rotary, RMSNorm, SwiGLU, dense                     -> LlamaForCausalLM
    rotary, RMSNorm, SwiGLU, top-k MoE in every layer  -> MixtralForCausalLM

Anything else is an ``HFConversionError`` that names every option blocking it.

The mapping is a list of ``Rule`` objects, one per piece of ours (a logical tensor, or one
expert), each with pure tensor functions both ways: our fused per-head QKV
``[heads, (q, k, v), head_dim]`` rows <-> GPT2's transposed Conv1D ``c_attn`` ``[h, q|k|v]``
or Llama's ``q_proj/k_proj/v_proj``; our interleaved SwiGLU rows ``(gate_j, up_j)`` <->
``gate_proj/up_proj`` (Mixtral: ``w1/w3``); GPT2's Conv1D weights are our Linear weights
transposed. Rotary embeddings need no permutation: ours are rotate-half, as HF Llama's.

Vocabulary: by default the HF model keeps our padded vocabulary (``vocab_size`` = padded
size), so it is the same function as ours (same logits, same loss, same greedy choices); the
tokenizer simply never emits the padding ids. ``trim_vocab`` cuts the rows to the
tokenizer's vocabulary instead (logits on real ids unchanged; the softmax no longer includes
the padding ids). Import picks ``--make-vocab-size-divisible-by`` so that our padded size
equals the HF vocabulary whenever TP allows (then nothing is padded and the function is
exact); otherwise the extra rows are zeros.

Both directions stream: export reads one piece of ours (concatenating its TP shards,
delinking a pseudo checkpoint on the fly), converts it and appends the result to the
current safetensors shard (headers are planned first from shapes alone, so nothing else is
held); import reads the HF tensors of one piece of ours and writes its TP shards. transformers
is needed only by ``verify_export``. See docs/hf.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from megatron_p2r.checkpoint.format import (
    _DTYPES, LATEST_FILE, METADATA_FILE, CheckpointError, ReaderCache, ShardLayout, ShardWriter, _nbytes, check_files,
    file_entries, iteration_dir_name, metadata_config, metadata_table, read_metadata, resolve_iteration_dir,
    shard_header_metadata, tensor_table, write_metadata, write_text_atomic)
from megatron_p2r.checkpoint.io import build_metadata
from megatron_p2r.checkpoint.reshard import (Target, _prepare_destination, _read_global, _shards, publish_staged,
                                             target_config, verify)
from megatron_p2r.config import Config, ConfigError, ModelConfig
from megatron_p2r.p2r import delink as dl

GPT2, LLAMA, MIXTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM"
MODEL_TYPES = {GPT2: "gpt2", LLAMA: "llama", MIXTRAL: "mixtral"}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# verify_export: fp32 on identical weights differs only by reduction order (~1e-7 on O(1) logits)
VERIFY_TOLERANCE = 1e-4
# HF tensors that are buffers, not weights (older GPT2 / Llama files carry them).
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$)")


class HFConversionError(ConfigError):
    """A model or HF directory that cannot be converted; the message names the option or field."""


# ----------------------------------------------------------------------------- architecture

def hf_architecture(m: ModelConfig) -> str:
    """The HF class that expresses ``m`` exactly, or an error listing every option that blocks it."""
    if m.num_experts:
        arch, why = MIXTRAL, "--num-experts is set"
        blockers = [
            (m.position_embedding_type != "rope", f"--position-embedding-type {m.position_embedding_type} "
                                                  "(Mixtral uses rotary: rope)"),
            (m.normalization != "RMSNorm", f"--normalization {m.normalization} (Mixtral uses RMSNorm)"),
            (not m.swiglu, "no --swiglu (Mixtral experts are SwiGLU)"),
            (m.moe_layer_freq != 1, f"--moe-layer-freq {m.moe_layer_freq} (Mixtral has MoE in every layer; "
                                    "dense layers in between have no HF equivalent)"),
            (m.moe_num_prototypes != 1, f"--moe-num-prototypes {m.moe_num_prototypes} (Mixtral routes top-k "
                                        "over all experts, not top-1 per prototype group)"),
            (not m.moe_renormalize_topk, "no --moe-renormalize-topk (Mixtral always renormalises the top-k "
                                         "routing weights to sum to 1)"),
            (m.moe_capacity_factor is not None, f"--moe-capacity-factor {m.moe_capacity_factor} (Mixtral is "
                                                "dropless; ours drops tokens over capacity)"),
            (m.add_bias, "biases in linear layers (Mixtral has none; pass --disable-bias-linear)"),
        ]
    elif m.position_embedding_type == "learned_absolute":
        arch, why = GPT2, "--position-embedding-type learned_absolute"
        blockers = [
            (m.normalization != "LayerNorm", f"--normalization {m.normalization} (GPT2 uses LayerNorm)"),
            (m.swiglu, "--swiglu (GPT2's MLP is GELU)"),
        ]
    else:
        arch, why = LLAMA, "--position-embedding-type rope"
        blockers = [
            (m.normalization != "RMSNorm", f"--normalization {m.normalization} (Llama uses RMSNorm)"),
            (not m.swiglu, "no --swiglu (Llama's MLP is SwiGLU)"),
        ]
    found = [msg for bad, msg in blockers if bad]
    if found:
        raise HFConversionError(f"cannot express this model in Hugging Face transformers: it maps to {arch} "
                                f"(because {why}), which cannot represent: " + "; ".join(found))
    return arch


# ----------------------------------------------------------------------------- tensor functions

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


# ----------------------------------------------------------------------------- configs

def hf_config(m: ModelConfig, arch: str, hf_vocab: int, dtype: str, special: Dict[str, Optional[int]]) -> dict:
    """config.json for ``m`` (a plain dict: writing it needs no transformers)."""
    common = {"architectures": [arch], "model_type": MODEL_TYPES[arch], "vocab_size": hf_vocab,
              "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
              "initializer_range": m.init_method_std, "use_cache": True, "dtype": dtype,
              "bos_token_id": special.get("bos"), "eos_token_id": special.get("eos"),
              "pad_token_id": special.get("pad")}
    if arch == GPT2:
        return {**common, "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
                "n_inner": m.ffn_size, "n_positions": m.max_positions, "activation_function": "gelu",
                "layer_norm_epsilon": m.norm_epsilon, "resid_pdrop": m.hidden_dropout,
                "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    cfg = {**common, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
           "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_attention_heads,
           "head_dim": m.head_dim, "hidden_act": "silu", "max_position_embeddings": m.max_positions,
           "rms_norm_eps": m.norm_epsilon, "attention_dropout": m.attention_dropout,
           # transformers 5 reads rope_parameters; 4.x reads rope_theta
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base}, "rope_theta": m.rotary_base}
    if arch == LLAMA:
        return {**cfg, "intermediate_size": m.ffn_size, "attention_bias": m.add_bias, "mlp_bias": m.add_bias,
                "pretraining_tp": 1}
    return {**cfg, "intermediate_size": m.expert_ffn_size, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "router_jitter_noise": m.moe_input_jitter_eps or 0.0, "output_router_logits": False,
            "sliding_window": None}


def _get(hf: dict, key: str, where: str, default=...):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFConversionError(f"{where}: required field {key!r} is missing")
    return default


def model_values_from_hf(hf: dict, where: str, allow_approximate_gelu: bool = False) -> Tuple[str, dict]:
    """(architecture, {ModelConfig field: value}) for an HF config.json, or an error naming the field."""
    model_type = hf.get("model_type")
    arch = {v: k for k, v in MODEL_TYPES.items()}.get(model_type)
    if arch is None:
        raise HFConversionError(f"{where}: model_type {model_type!r} is not supported; "
                                f"import reads {sorted(MODEL_TYPES.values())}")
    tied = bool(hf.get("tie_word_embeddings", True))
    if arch == GPT2:
        act = hf.get("activation_function", "gelu_new")
        if act != "gelu" and not (allow_approximate_gelu and act in ("gelu_new", "gelu_pytorch_tanh")):
            raise HFConversionError(
                f"{where}: activation_function {act!r}; our GPT model uses exact (erf) GELU. "
                + ("Pass --allow-approximate-gelu to import anyway (outputs then differ slightly)."
                   if act in ("gelu_new", "gelu_pytorch_tanh") else "It cannot be imported."))
        for key, want in [("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                          ("scale_attn_weights", True), ("add_cross_attention", False)]:
            if hf.get(key, want) != want:
                raise HFConversionError(f"{where}: {key} = {hf[key]!r} has no equivalent here (need {want})")
        h = _get(hf, "n_embd", where)
        return arch, dict(
            num_layers=_get(hf, "n_layer", where), hidden_size=h, num_attention_heads=_get(hf, "n_head", where),
            ffn_hidden_size=hf.get("n_inner") or 4 * h, max_position_embeddings=_get(hf, "n_positions", where),
            normalization="LayerNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), swiglu=False,
            position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=not tied,
            disable_bias_linear=False, hidden_dropout=hf.get("resid_pdrop", 0.0),
            attention_dropout=hf.get("attn_pdrop", 0.0), init_method_std=hf.get("initializer_range", 0.02))
    h, heads = _get(hf, "hidden_size", where), _get(hf, "num_attention_heads", where)
    kv = hf.get("num_key_value_heads") or heads
    if kv != heads:
        raise HFConversionError(f"{where}: num_key_value_heads {kv} != num_attention_heads {heads}; grouped-query "
                                "attention has no equivalent here")
    if hf.get("head_dim") not in (None, h // heads):
        raise HFConversionError(f"{where}: head_dim {hf['head_dim']} != hidden_size/num_attention_heads "
                                f"({h // heads})")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"{where}: hidden_act {hf['hidden_act']!r}; only SwiGLU (silu) is supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFConversionError(f"{where}: rope type {kind!r} (rope scaling) has no equivalent here")
    if hf.get("sliding_window") is not None:
        raise HFConversionError(f"{where}: sliding_window {hf['sliding_window']} has no equivalent here")
    bias = bool(hf.get("attention_bias", False))
    if arch == LLAMA and bool(hf.get("mlp_bias", False)) != bias:
        raise HFConversionError(f"{where}: attention_bias {bias} with mlp_bias {hf.get('mlp_bias')}; "
                                "--disable-bias-linear removes both or neither")
    max_pos = hf.get("max_position_embeddings", 4096)
    values = dict(num_layers=_get(hf, "num_hidden_layers", where), hidden_size=h, num_attention_heads=heads,
                  ffn_hidden_size=_get(hf, "intermediate_size", where), normalization="RMSNorm",
                  norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, position_embedding_type="rope",
                  rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                  max_position_embeddings=max_pos, untie_embeddings_and_output_weights=not tied,
                  disable_bias_linear=not bias, attention_dropout=hf.get("attention_dropout", 0.0),
                  init_method_std=hf.get("initializer_range", 0.02))
    if arch == MIXTRAL:
        values.update(num_experts=_get(hf, "num_local_experts", where),
                      moe_router_topk=_get(hf, "num_experts_per_tok", where), moe_layer_freq=1,
                      moe_ffn_hidden_size=values["ffn_hidden_size"], moe_renormalize_topk=True,
                      moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
                      moe_input_jitter_eps=hf.get("router_jitter_noise") or None)
    return arch, values


def import_vocab_divisor(vocab: int, tp: int, requested: Optional[int] = None) -> int:
    """``--make-vocab-size-divisible-by`` for an imported vocabulary: the largest power of two
    (<= 128) that divides it and is a multiple of TP, so nothing is padded; else 128 (or TP)."""
    if requested is not None:
        if requested < 1 or requested % tp:
            raise HFConversionError(f"--make-vocab-size-divisible-by {requested} must be >= 1 and divisible "
                                    f"by the target TP ({tp})")
        return requested
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if d % tp == 0 and vocab % d == 0:
            return d
    return 128 if 128 % tp == 0 else tp


# ----------------------------------------------------------------------------- tokenizers

def export_tokenizer(cfg: Config, dst: str) -> Tuple[str, Dict[str, Optional[int]]]:
    """Copy the run's tokenizer files with a tokenizer_config.json when HF can express them.
    Returns (a line saying what was done, special token ids for config.json)."""
    d = cfg.data
    kind = d.tokenizer_type
    if kind == "GPT2BPETokenizer":
        missing = [f for f in (d.vocab_file, d.merge_file) if not f or not os.path.isfile(f)]
        if missing:
            return f"tokenizer not copied: GPT2BPETokenizer file {missing[0]} is not readable here", {}
        from megatron_p2r.data.tokenizers import GPT2_EOD
        with open(d.vocab_file, encoding="utf-8") as fh:
            eod = json.load(fh)[GPT2_EOD]
        shutil.copyfile(d.vocab_file, os.path.join(dst, "vocab.json"))
        shutil.copyfile(d.merge_file, os.path.join(dst, "merges.txt"))
        _write_json(os.path.join(dst, "tokenizer_config.json"), {
            "tokenizer_class": "GPT2Tokenizer", "bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
            "unk_token": GPT2_EOD, "add_prefix_space": False, "model_max_length": cfg.model.max_positions})
        return "tokenizer: GPT2Tokenizer (vocab.json, merges.txt)", {"bos": eod, "eos": eod}
    if kind == "SentencePieceTokenizer":
        if not d.tokenizer_model or not os.path.isfile(d.tokenizer_model):
            return f"tokenizer not copied: SentencePiece model {d.tokenizer_model} is not readable here", {}
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=d.tokenizer_model)
        ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
        ids = {k: (v if v >= 0 else None) for k, v in ids.items()}
        shutil.copyfile(d.tokenizer_model, os.path.join(dst, "tokenizer.model"))
        # LlamaTokenizer reads a SentencePiece model; no BOS/EOS added, SentencePiece's dummy prefix kept.
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                  "add_prefix_space": True, "legacy": False, "model_max_length": cfg.model.max_positions}
        for k, v in ids.items():
            if v is not None:
                config[f"{k}_token"] = sp.id_to_piece(v)
        _write_json(os.path.join(dst, "tokenizer_config.json"), config)
        return "tokenizer: LlamaTokenizer (tokenizer.model)", {k: ids[k] for k in ("bos", "eos", "pad")}
    if kind == "ByteTokenizer":
        return ("tokenizer not copied: ByteTokenizer (ids = bytes, 256 = end of document) has no Hugging Face "
                "equivalent; encode text as UTF-8 bytes yourself"), {"eos": 256}
    return "tokenizer not copied: the checkpoint records no --tokenizer-type", {}


_HF_TOKENIZERS = [(("vocab.json", "merges.txt"), "GPT2BPETokenizer", ("vocab_file", "merge_file")),
                  (("tokenizer.model",), "SentencePieceTokenizer", ("tokenizer_model",))]


def import_tokenizer(src: str, out: str, final: str) -> Tuple[str, dict]:
    """Copy an HF tokenizer we can read into ``out/tokenizer``; (a line, our data flags naming the
    files under ``final``, where ``out`` is renamed to when complete)."""
    for files, kind, fields in _HF_TOKENIZERS:
        if all(os.path.isfile(os.path.join(src, f)) for f in files):
            os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
            flags = {"tokenizer_type": kind}
            for f, field in zip(files, fields):
                shutil.copyfile(os.path.join(src, f), os.path.join(out, "tokenizer", f))
                flags[field] = os.path.abspath(os.path.join(final, "tokenizer", f))
            return f"tokenizer: {kind} ({', '.join(files)}) copied to {os.path.join(final, 'tokenizer')}", flags
    return ("tokenizer not copied: no vocab.json+merges.txt or tokenizer.model in the source "
            "(a tokenizer.json alone cannot be read by our data tools)"), {}


# ----------------------------------------------------------------------------- shards

def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise HFConversionError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MiB or 1000000")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def plan_shards(groups: Sequence[Sequence[Tuple[str, str, tuple]]], limit: int) -> List[List[int]]:
    """Split rule outputs (each a list of (name, dtype, shape), kept together) into files of at
    most ``limit`` bytes (a group larger than the limit gets a file of its own)."""
    files: List[List[int]] = [[]]
    size = 0
    for i, group in enumerate(groups):
        nbytes = sum(_nbytes(d, s) for _, d, s in group)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


# ----------------------------------------------------------------------------- export

@dataclasses.dataclass
class ExportResult:
    directory: str
    architecture: str
    files: List[str]
    vocab_size: int
    notes: List[str]


def _single_real_config(cfg: Config) -> Config:
    """The same model, real phase, on one process (its table lists every real piece in model order)."""
    return target_config(cfg, Target(1, 1, None, 1), delink=cfg.p2r.p2r_phase == "pseudo")


class SourceCheckpoint:
    """Global real-model pieces of a checkpoint of ours in any layout; a pseudo one is delinked
    on the fly (real layer i reads the module its pseudo layer called)."""

    def __init__(self, path: str):
        self.iter_dir = resolve_iteration_dir(path)
        self.meta = read_metadata(self.iter_dir)
        self.readers = check_files(self.iter_dir, self.meta)
        self.cfg = metadata_config(self.meta)
        self.table = metadata_table(self.meta)
        self.layout = ShardLayout.of(self.cfg)
        self.pseudo = self.meta["p2r"]["phase"] == "pseudo"
        self.layer_keys = self.meta["p2r"]["layer_module_keys"]
        self.real_cfg = _single_real_config(self.cfg)

    def read(self, key: str) -> torch.Tensor:
        skey = dl.source_key(key, self.layer_keys) if self.pseudo else key
        info = self.table.get(skey)
        if info is None:
            raise CheckpointError(f"{os.path.join(self.iter_dir, METADATA_FILE)}: tensors has no {skey!r}")
        return _read_global(self.readers, self.layout, info, "model")


def export_hf(src: str, dst: str, *, trim_vocab: bool = False, dtype: str = "float32",
              max_shard_size: str = "5GB", force: bool = False, progress: bool = True) -> ExportResult:
    """Write SRC (any layout, real or pseudo) as an HF model directory DST, streaming."""
    if dtype not in EXPORT_DTYPES:
        raise HFConversionError(f"--dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    source = SourceCheckpoint(src)
    m = source.real_cfg.model
    arch = hf_architecture(m)
    limit = parse_size(max_shard_size)
    hf_vocab = m.vocab_size if trim_vocab else m.padded_vocab_size
    torch_dtype = EXPORT_DTYPES[dtype]
    st_dtype = _DTYPES[torch_dtype]
    table = tensor_table(source.real_cfg)
    plan = rules(m, arch, hf_vocab)
    covered = {r.ours for r in plan if r.ours}
    if covered != set(table):  # the mapping must account for every weight, no more, no less
        raise HFConversionError(f"internal: {arch} mapping misses {sorted(set(table) - covered)[:3]} "
                                f"or invents {sorted(covered - set(table))[:3]}")
    groups = []
    for r in plan:
        if r.ours is None:
            shapes = [r.zero_shape]
        else:
            shapes = [tuple(t.shape) for t in r.to_hf(torch.empty(table[r.ours].shape, device="meta"))]
        groups.append([(name, st_dtype, s) for name, s in zip(r.hf, shapes)])
    files = plan_shards(groups, limit)
    names = [SINGLE_FILE] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]

    total = sum(_nbytes(d, s) for g in groups for _, d, s in g)
    tmp = _prepare_destination(src, source.iter_dir, dst, force)
    try:
        bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="export-hf")
        weight_map = {}
        for name, members in zip(names, files):
            entries = [e for i in members for e in groups[i]]
            writer = ShardWriter(os.path.join(tmp, name), entries, {"format": "pt"})
            for i in members:
                r = plan[i]
                if r.ours is None:
                    outs = [torch.zeros(r.zero_shape, dtype=torch_dtype)]
                else:
                    outs = r.to_hf(source.read(r.ours).to(torch_dtype))
                for (hf_name, _, _), t in zip(groups[i], outs):
                    writer.write(hf_name, t)
                    weight_map[hf_name] = name
                    bar.update(t.numel() * t.element_size())
            writer.close()
        bar.close()
        if len(names) > 1:
            _write_json(os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
        note, special = export_tokenizer(source.cfg, tmp)
        config = hf_config(m, arch, hf_vocab, dtype, special)
        _write_json(os.path.join(tmp, "config.json"), config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_staged(tmp, dst)
    notes = [note]
    if source.pseudo:
        notes.append(f"delinked on the fly from the pseudo phase (layer -> module {source.layer_keys})")
    if hf_vocab != m.padded_vocab_size:
        notes.append(f"vocabulary trimmed from {m.padded_vocab_size} (padded) to {hf_vocab} rows")
    elif m.vocab_size != hf_vocab:
        notes.append(f"vocabulary kept padded: {hf_vocab} rows for {m.vocab_size} tokens (--trim-vocab cuts it)")
    return ExportResult(dst, arch, names, hf_vocab, notes)


# ----------------------------------------------------------------------------- import

def read_hf_config(path: str) -> dict:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise HFConversionError(f"{path}: no config.json (not a Hugging Face model directory)")
    with open(config, encoding="utf-8") as fh:
        return json.load(fh)


class HFDirectory:
    """The safetensors weights of an HF model directory (one file, or shards with an index)."""

    def __init__(self, path: str):
        self.path = path
        self.readers = ReaderCache(path)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                self.weight_map = json.load(fh)["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.weight_map = {n: SINGLE_FILE for n in self.readers(SINGLE_FILE).names()}
        else:
            found = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
            raise HFConversionError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}"
                                    + (f" (found {found[0]}: only safetensors are read, never pickles)"
                                       if found else ""))

    def resolve(self, name: str) -> Optional[str]:
        """The stored name of ``name``, also when the file omits the base prefix (original GPT2: ``h.0.``)."""
        if name in self.weight_map:
            return name
        short = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else None
        return short if short in self.weight_map else None

    def entry(self, stored: str) -> dict:
        return self.readers(self.weight_map[stored]).entries[stored]

    def read(self, stored: str) -> torch.Tensor:
        return self.readers(self.weight_map[stored]).read(stored)


def import_hf(src: str, dst: str, target: Target, *, make_vocab_size_divisible_by: Optional[int] = None,
              allow_approximate_gelu: bool = False, force: bool = False,
              progress: bool = True) -> Tuple[str, List[str]]:
    """Write the HF model SRC as a checkpoint of ours (real phase, iteration 0, no optimizer
    state) in the ``target`` layout. Returns (iteration directory, notes)."""
    hf_cfg = read_hf_config(src)
    where = os.path.join(src, "config.json")
    arch, values = model_values_from_hf(hf_cfg, where, allow_approximate_gelu)
    hf_vocab = _get(hf_cfg, "vocab_size", where)
    hf = HFDirectory(src)
    tp = target.tensor_parallel_size or 1
    divisor = import_vocab_divisor(hf_vocab, tp, make_vocab_size_divisible_by)
    values.update(vocab_size=hf_vocab, make_vocab_size_divisible_by=divisor,
                  seq_length=min(values["max_position_embeddings"], 4096))
    base = Config.from_dict({"model": values})
    cfg = target_config(base, Target(target.tensor_parallel_size or 1, target.pipeline_parallel_size or 1,
                                     target.pipeline_layer_split, target.expert_parallel_size), delink=False)
    m = cfg.model
    plan = {r.ours: r for r in rules(m, arch, hf_vocab)}
    table = tensor_table(cfg)
    used = set()
    for key, info in table.items():  # check every needed tensor before writing anything
        r = plan[key]
        shapes = [tuple(t.shape) for t in r.to_hf(torch.empty(info.shape, device="meta"))]
        for name, shape in zip(r.hf, shapes):
            stored = hf.resolve(name)
            if stored is None:
                raise HFConversionError(f"{src}: the weights have no tensor {name!r} (needed for our {key!r})")
            if tuple(hf.entry(stored)["shape"]) != shape:
                raise HFConversionError(f"{src}: tensor {stored!r} has shape {hf.entry(stored)['shape']}, "
                                        f"config.json implies {list(shape)}")
            used.add(stored)
    unused = sorted(n for n in hf.weight_map if n not in used and not _IGNORED.search(n)
                    and not (n == "lm_head.weight" and not m.untie_embeddings_and_output_weights))
    if unused:
        raise HFConversionError(f"{src}: {len(unused)} tensors have no place in our model, e.g. {unused[0]!r}; "
                                "refusing to drop weights")

    layout = ShardLayout.of(cfg)
    tmp = _prepare_destination(src, src, dst, force)
    notes = []
    try:
        out_iter = os.path.join(tmp, iteration_dir_name(0))
        os.makedirs(out_iter)
        _write_pieces(out_iter, table, layout, lambda key: plan[key].from_hf(
            [hf.read(hf.resolve(n)).float() for n in plan[key].hf]), progress)
        files = {f: os.path.getsize(os.path.join(out_iter, f)) for f in layout.files()}
        from megatron_p2r.optim.grad_scaler import LossScaler
        meta = build_metadata(cfg, table, iteration=0, consumed_samples=0, optimizer=False,
                              scheduler={"step_count": 0}, scaler=LossScaler(cfg.train).state_dict(), files=files,
                              rng=None, history=[{"op": "import-hf", "source": os.path.abspath(src),
                                                  "source_layout": f"hf:{arch}"}])
        write_metadata(out_iter, meta)
        verify(out_iter, meta, expected_params=sum(i.numel for i in table.values()))
        note, flags = import_tokenizer(src, tmp, dst)
        notes.append(note)
        _write_model_yaml(os.path.join(tmp, "model.yaml"), cfg, flags)
        write_text_atomic(os.path.join(tmp, LATEST_FILE), "0")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_staged(tmp, dst)
    if m.padded_vocab_size != hf_vocab:
        notes.append(f"vocabulary padded from {hf_vocab} to {m.padded_vocab_size} rows with zeros "
                     f"(TP {layout.tp} does not divide {hf_vocab}); their logits (0) enter our softmax")
    yaml_path = os.path.join(dst, "model.yaml")
    notes.append(f"model and layout flags in {yaml_path}: train with --config {yaml_path} --load {dst} "
                 "--finetune plus data and training flags")
    return os.path.join(dst, iteration_dir_name(0)), notes


def _write_pieces(out_iter: str, table, layout: ShardLayout, produce: Callable[[str], torch.Tensor],
                  progress: bool) -> None:
    """Write every piece of ``table`` (weights only) as ``layout``'s TP shards, one stage's files at a time."""
    entries = file_entries(table, layout, ("model",))
    bar = tqdm(total=sum(i.nbytes for i in table.values()), unit="B", unit_scale=True, disable=not progress,
               desc="import-hf")
    writers: Dict[str, ShardWriter] = {}
    stage = -1
    for key, info in table.items():
        if info.stage != stage:
            for w in writers.values():
                w.close()
            writers.clear()
            stage = info.stage
            for name in layout.stage_files(stage):
                writers[name] = ShardWriter(os.path.join(out_iter, name), entries[name], shard_header_metadata(name))
        tensor = produce(key).to(torch.float32).contiguous()
        for t, shard in _shards(tensor, info, layout, "model"):
            writers[layout.file_of(info, t)].write(key, shard)
        bar.update(info.nbytes)
    for w in writers.values():
        w.close()
    for name, ents in entries.items():  # stages owning no piece still have their (empty) files
        if not os.path.exists(os.path.join(out_iter, name)):
            ShardWriter(os.path.join(out_iter, name), ents, shard_header_metadata(name)).close()
    bar.close()


def _write_model_yaml(path: str, cfg: Config, data_flags: dict) -> None:
    """The model and layout flags of the imported checkpoint, for ``--config`` (flat, dashed keys)."""
    import yaml
    values = {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None}
    p = cfg.parallel
    values.update(tensor_model_parallel_size=p.tensor_model_parallel_size,
                  pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                  expert_model_parallel_size=p.expert_model_parallel_size, **data_flags)
    if p.pipeline_layer_split:
        values["pipeline_layer_split"] = p.pipeline_layer_split
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump({k.replace("_", "-"): v for k, v in values.items()}, fh, sort_keys=False)


# ----------------------------------------------------------------------------- verification

def load_reference_model(src: str, dtype: torch.dtype = torch.float32):
    """Our one-process real model with SRC's weights (rounded to ``dtype``), and its config."""
    from megatron_p2r.model.m6 import build_model
    from megatron_p2r.parallel.sharding import expert_key, logical_name
    from megatron_p2r.parallel.state import ParallelState
    source = SourceCheckpoint(src)
    model = build_model(source.real_cfg, ParallelState.single(), meta=True)
    keys = {name: (logical_name(name, p), getattr(p, "expert", False)) for name, p in model.named_parameters()}
    model = model.to_empty(device="cpu")  # (allocates new parameters, without the sharding attributes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            key, expert = keys[name]
            if expert:
                for e in range(p.shape[0]):
                    p[e].copy_(source.read(expert_key(key, e)).to(dtype))
            else:
                p.copy_(source.read(key).to(dtype))
    return model.eval(), source.real_cfg


def verify_export(src: str, dst: str, *, batch: int = 2, seq: int = 16, seed: int = 0) -> float:
    """Max |logit difference| between DST loaded by transformers and our model on random ids.

    Both run in fp32 on identical weights (ours rounded to DST's dtype), so the difference is
    only reduction order; trimmed vocabularies are compared on the rows DST has."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise HFConversionError("verification needs transformers: pip install 'megatron_p2r[hf]' "
                                "(the exported files are written and usable without it)") from None
    with open(os.path.join(dst, "config.json"), encoding="utf-8") as fh:
        dtype = EXPORT_DTYPES[json.load(fh)["dtype"]]
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    ours, cfg = load_reference_model(src, dtype)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, min(seq, cfg.model.max_positions)),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a = ours(tokens=ids)
        b = hf(input_ids=ids).logits
    return (a[..., :b.shape[-1]] - b).abs().max().item()
