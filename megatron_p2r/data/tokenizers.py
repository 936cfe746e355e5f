"""Tokenizers selected by ``--tokenizer-type``; each has vocab_size, eod, pad, encode, decode.

- ``SentencePieceTokenizer``: a ``.model`` from tools/train_tokenizer.py or elsewhere.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``, implemented
  here (``regex`` pre-tokenisation, a per-word cache) so it needs no Hugging Face packages and
  encodes exactly as GPT-2 / Megatron-LM / HF ``ByteLevelBPETokenizer`` do.
- ``ByteTokenizer``: the 256 byte values plus end-of-document and padding; needs no files.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Iterable, List, Optional

from megatron_p2r.config import ConfigError, DataConfig


class ByteTokenizer:
    """Token id = byte value (0..255) of the UTF-8 text; 256 is end-of-document, 257 padding."""

    eod = 256
    pad = 257
    vocab_size = 258

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model; eod is its ``</s>`` piece, pad its pad piece (eod when it has none)."""

    def __init__(self, model_file: str):
        import sentencepiece

        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"--tokenizer-model {model_file}: not a SentencePiece model ({exc})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ConfigError(f"--tokenizer-model {model_file}: the model has no end-of-sentence piece "
                              "(train it with an eos_id, as tools/train_tokenizer.py does)")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def encode(self, text: str) -> List[int]:
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return self._sp.Encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


# GPT-2's pre-tokenisation: contractions, letter runs, digit runs, other symbols, whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict:
    """GPT-2's reversible map from the 256 bytes to printable characters (vocab.json keys use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class GPT2BPETokenizer:
    """Byte-level BPE: split with GPT2_PATTERN, map bytes to characters, merge by rank."""

    def __init__(self, vocab_file: str, merge_file: str):
        import regex

        self.vocab_file, self.merge_file = vocab_file, merge_file
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--vocab-file {vocab_file}: cannot read a JSON vocabulary ({exc})") from None
        if not isinstance(self.encoder, dict) or not all(isinstance(v, int) for v in self.encoder.values()):
            raise ConfigError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")
        try:
            with open(merge_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--merge-file {merge_file}: cannot read merges ({exc})") from None
        merges = []
        for n, line in enumerate(lines, 1):
            if not line or line.startswith("#version"):
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise ConfigError(f"--merge-file {merge_file}: line {n} is not two space-separated symbols: {line!r}")
            merges.append(tuple(pair))
        if GPT2_EOD not in self.encoder:
            raise ConfigError(f"--vocab-file {vocab_file}: no {GPT2_EOD} token for end-of-document")
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._byte_table = {b: ord(c) for b, c in self.byte_encoder.items()}  # latin-1 code point -> vocab char
        self._pattern = regex.compile(GPT2_PATTERN)
        self._cache: dict = {}
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder[GPT2_EOD]
        self.pad = self.eod

    def _bpe(self, word: str) -> List[str]:
        """Merge the lowest-ranked adjacent pair everywhere, until no known pair remains."""
        parts = list(word)
        ranks = self.bpe_ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            first, second = best
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _encode_token(self, token: str) -> List[int]:
        """BPE ids of one pre-token, cached by the raw token so repeats skip the byte mapping too."""
        word = token.encode("utf-8").decode("latin-1").translate(self._byte_table)
        try:
            ids = [self.encoder[piece] for piece in self._bpe(word)]
        except KeyError as exc:
            raise ValueError(f"--vocab-file {self.vocab_file}: no entry for BPE piece {exc.args[0]!r}") from None
        if len(self._cache) < 1_000_000:  # bounded: a long stream of unique words must not exhaust memory
            self._cache[token] = ids
        return ids

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        for token in self._pattern.findall(text):
            ids += self._cache.get(token) or self._encode_token(token)
        return ids

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


def _require_file(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if not path:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    return path


def build_tokenizer(data_cfg: DataConfig):
    """The tokenizer ``data_cfg`` names; missing or unreadable files are ConfigErrors naming the flag."""
    kind = data_cfg.tokenizer_type
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_require_file("--tokenizer-model", data_cfg.tokenizer_model, kind))
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require_file("--vocab-file", data_cfg.vocab_file, kind),
                                _require_file("--merge-file", data_cfg.merge_file, kind))
    raise ConfigError(f"--tokenizer-type must be one of SentencePieceTokenizer, GPT2BPETokenizer, "
                      f"ByteTokenizer; got {kind!r}")
