"""Tokenizer files between our runs and HF directories: export copies the run's tokenizer with a
tokenizer_config.json when HF can express it; import copies an HF tokenizer our data tools read."""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional, Tuple

from megatron_p2r.checkpoint.hf.architecture import HFConversionError
from megatron_p2r.checkpoint.hf.directory import write_json
from megatron_p2r.config import Config
from megatron_p2r.data.tokenizers import GPT2_EOD
from megatron_p2r.files import confined


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
        write_json(os.path.join(dst, "tokenizer_config.json"), {
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
        write_json(os.path.join(dst, "tokenizer_config.json"), config)
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
        if all(os.path.isfile(confined(src, f, HFConversionError, "tokenizer file")) for f in files):
            os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
            flags = {"tokenizer_type": kind}
            for f, field in zip(files, fields):
                shutil.copyfile(os.path.join(src, f), os.path.join(out, "tokenizer", f))
                flags[field] = os.path.abspath(os.path.join(final, "tokenizer", f))
            return f"tokenizer: {kind} ({', '.join(files)}) copied to {os.path.join(final, 'tokenizer')}", flags
    return ("tokenizer not copied: no vocab.json+merges.txt or tokenizer.model in the source "
            "(a tokenizer.json alone cannot be read by our data tools)"), {}
