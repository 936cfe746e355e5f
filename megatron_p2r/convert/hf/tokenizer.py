"""Tokenizer files between our runs and HF directories: export copies the run's tokenizer with a
tokenizer_config.json when HF can express it; import copies an HF tokenizer our data tools read."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Dict, Optional, Tuple

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.directory import write_json
from megatron_p2r.config import Config, ConfigError, DataConfig
from megatron_p2r.data.hf_tokenizer import HuggingFaceTokenizer
from megatron_p2r.data.tokenizers import GPT2_EOD, build_tokenizer
from megatron_p2r.files import confined

# What transformers' AutoTokenizer reads beside tokenizer.json (the special tokens' roles).
HF_TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


def export_tokenizer(cfg: Config, dst: str) -> Tuple[str, Dict[str, Optional[int]]]:
    """Copy the run's tokenizer files with a tokenizer_config.json when HF can express them.
    Returns (a line saying what was done, special token ids for config.json)."""
    d = cfg.data
    kind = d.tokenizer_type
    if kind == "GPT2BPETokenizer":
        missing = [f for f in (d.vocab_file, d.merge_file) if not f or not os.path.isfile(f)]
        if missing:
            return f"tokenizer not copied: GPT2BPETokenizer file {missing[0]} is not readable here", {}
        with open(d.vocab_file, encoding="utf-8") as fh:
            eod = json.load(fh)[GPT2_EOD]
        shutil.copyfile(d.vocab_file, os.path.join(dst, "vocab.json"))
        shutil.copyfile(d.merge_file, os.path.join(dst, "merges.txt"))
        write_json(
            os.path.join(dst, "tokenizer_config.json"),
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": GPT2_EOD,
                "eos_token": GPT2_EOD,
                "unk_token": GPT2_EOD,
                "add_prefix_space": False,
                "model_max_length": cfg.model.max_positions,
            },
        )
        return "tokenizer: GPT2Tokenizer (vocab.json, merges.txt)", {"bos": eod, "eos": eod}
    if kind == "SentencePieceTokenizer":
        return _export_sentencepiece(cfg, dst)
    if kind == "HuggingFaceTokenizer":
        return _export_hf_tokenizer(cfg, dst)
    if kind == "TikTokenizer":
        return _export_tiktoken(cfg, dst)
    if kind == "ByteTokenizer":
        return (
            "tokenizer not copied: ByteTokenizer (ids = bytes, 256 = end of document) has no Hugging Face "
            "equivalent; encode text as UTF-8 bytes yourself"
        ), {"eos": 256}
    if kind is None:
        return "tokenizer not copied: the checkpoint records no --tokenizer-type", {}
    return f"tokenizer not copied: --tokenizer-type {kind} is not exported (docs/hf.md)", {}


def _export_sentencepiece(cfg: Config, dst: str) -> Tuple[str, Dict[str, Optional[int]]]:
    d = cfg.data
    if not d.tokenizer_model or not os.path.isfile(d.tokenizer_model):
        return f"tokenizer not copied: SentencePiece model {d.tokenizer_model} is not readable here", {}
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=d.tokenizer_model)
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
    ids = {k: (v if v >= 0 else None) for k, v in ids.items()}
    shutil.copyfile(d.tokenizer_model, os.path.join(dst, "tokenizer.model"))
    # LlamaTokenizer reads a SentencePiece model; no BOS/EOS added, SentencePiece's dummy prefix kept.
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": True,
        "legacy": False,
        "model_max_length": cfg.model.max_positions,
    }
    for k, v in ids.items():
        if v is not None:
            config[f"{k}_token"] = sp.id_to_piece(v)
    write_json(os.path.join(dst, "tokenizer_config.json"), config)
    return "tokenizer: LlamaTokenizer (tokenizer.model)", {k: ids[k] for k in ("bos", "eos", "pad")}


def _export_hf_tokenizer(cfg: Config, dst: str) -> Tuple[str, Dict[str, Optional[int]]]:
    """tokenizer.json and the files that give its special tokens their roles, as they are (our
    HuggingFaceTokenizer reads them as transformers does); a minimal tokenizer_config.json when
    the run had none."""
    try:
        tokenizer = HuggingFaceTokenizer(cfg.data.tokenizer_model)
    except ConfigError as exc:
        return f"tokenizer not copied: {exc}", {}
    copied = ["tokenizer.json"]
    shutil.copyfile(tokenizer.path, os.path.join(dst, "tokenizer.json"))
    for name in HF_TOKENIZER_CONFIGS:
        path = os.path.join(os.path.dirname(tokenizer.path), name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    if "tokenizer_config.json" not in copied:
        write_json(
            os.path.join(dst, "tokenizer_config.json"),
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.max_positions},
        )
    return f"tokenizer: PreTrainedTokenizerFast ({', '.join(copied)})", {"bos": tokenizer.bos, "eos": tokenizer.eod}


def _export_tiktoken(cfg: Config, dst: str) -> Tuple[str, Dict[str, Optional[int]]]:
    """Megatron's tiktoken vocabulary as a ``tokenizers`` byte-level BPE (transformers' own
    TikTokenConverter: merges recovered from the ranks, the same split pattern), the special tokens
    at their ids 0..N-1, so PreTrainedTokenizerFast encodes as the run did."""
    try:
        tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    except ConfigError as exc:
        return f"tokenizer not copied: {exc}", {}
    from megatron_p2r.convert.hf.tiktoken_export import tiktoken_to_tokenizers

    tiktoken_to_tokenizers(tokenizer).save(os.path.join(dst, "tokenizer.json"))
    write_json(
        os.path.join(dst, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "model_max_length": cfg.model.max_positions,
        },
    )
    return (
        "tokenizer: PreTrainedTokenizerFast (tokenizer.json from the TikTokenizer vocabulary)",
        {"bos": tokenizer.bos, "eos": tokenizer.eod, "pad": tokenizer.pad},
    )


@dataclasses.dataclass(frozen=True)
class HFTokenizerFiles:
    """A tokenizer of an HF directory that our data tools read: its type, the files to copy, the
    flag each file (or, for "", the tokenizer directory) is passed with, and its vocabulary."""

    kind: str
    files: Tuple[str, ...]
    flags: Tuple[Tuple[str, str], ...]  # (DataConfig field, file name or "" for the directory)
    vocab_size: int


# In the order transformers' AutoTokenizer prefers them (a fast tokenizer.json first).
_HF_TOKENIZERS = [
    (("tokenizer.json",), HF_TOKENIZER_CONFIGS, "HuggingFaceTokenizer", (("tokenizer_model", ""),)),
    (
        ("vocab.json", "merges.txt"),
        (),
        "GPT2BPETokenizer",
        (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")),
    ),
    (("tokenizer.model",), (), "SentencePieceTokenizer", (("tokenizer_model", "tokenizer.model"),)),
]


def find_tokenizer(src: str) -> Tuple[Optional[HFTokenizerFiles], str]:
    """The tokenizer of the HF directory SRC our data tools read (None and why when there is none)."""

    def present(name: str) -> bool:  # a regular file inside SRC (a link out of it is an error)
        return os.path.isfile(confined(src, name, HFConversionError, "tokenizer file"))

    for required, optional, kind, flags in _HF_TOKENIZERS:
        if all(present(f) for f in required):
            values = {field: os.path.join(src, name) for field, name in flags}
            try:
                tokenizer = build_tokenizer(DataConfig(tokenizer_type=kind, **values))
            except ConfigError as exc:
                return None, f"tokenizer not copied: {exc}"
            files = required + tuple(f for f in optional if present(f))
            return HFTokenizerFiles(kind, files, flags, tokenizer.vocab_size), ""
    return None, ("tokenizer not copied: no tokenizer.json, vocab.json+merges.txt or tokenizer.model in the source")


def copy_tokenizer(found: HFTokenizerFiles, src: str, out: str, final: str) -> Tuple[str, dict]:
    """Copy ``found``'s files into ``out/tokenizer``; (a line, our data flags naming the files under
    ``final``, where ``out`` is renamed to when complete)."""
    os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
    for name in found.files:
        shutil.copyfile(os.path.join(src, name), os.path.join(out, "tokenizer", name))
    directory = os.path.abspath(os.path.join(final, "tokenizer"))
    flags = {
        "tokenizer_type": found.kind,
        **{field: os.path.join(directory, name) if name else directory for field, name in found.flags},
    }
    return f"tokenizer: {found.kind} ({', '.join(found.files)}) copied to {directory}", flags
