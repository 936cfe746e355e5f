"""Tokenizers selected by ``--tokenizer-type``; each has vocab_size, eod, pad, encode, decode.

Megatron-LM's names mean what they mean in Megatron-LM (docs/data.md says which version):

- ``SentencePieceTokenizer`` (= Megatron's ``GPTSentencePieceTokenizer``): a ``.model``.
- ``Llama2Tokenizer``: a SentencePiece ``.model`` with Llama's convention, bos before every text.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``, implemented
  here (``regex`` pre-tokenisation, a per-word cache) so it needs no Hugging Face packages and
  encodes exactly as GPT-2 / Megatron-LM / HF ``ByteLevelBPETokenizer`` do.
- ``HuggingFaceTokenizer``: a local ``tokenizer.json`` through ``tokenizers`` (hf_tokenizer.py).
- ``TikTokenizer``: Megatron's JSON tiktoken vocabulary through ``tiktoken`` (tiktoken_tokenizer.py).
- ``NullTokenizer``: the text is already ids, space-separated; ``--vocab-size`` ids, eod the last.
- ``ByteTokenizer``: the 256 byte values plus end-of-document and padding; needs no files.

``special_tokens_in_text`` says what a special token's literal text inside a document becomes:
``"id"`` that token's id (Hugging Face's rule), ``"text"`` ordinary text (SentencePiece's).
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Callable, Dict, Iterable, List, Optional

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.hf_tokenizer import HuggingFaceTokenizer
from megatron_p2r.data.tiktoken_tokenizer import TikTokenizer
from megatron_p2r.files import read_json

SPECIAL_TOKENS_IN_TEXT = ("id", "text")


class TextEncodingError(ValueError):
    """A text this tokenizer cannot encode: a bad input line, not a configuration problem."""


class SpecialTokens:
    """Literal special tokens inside text, encoded as their ids with Hugging Face's rule: the
    leftmost match, the longest one there; the text between matches is encoded on its own."""

    def __init__(self, ids: Dict[str, int]):
        if not ids or "" in ids:
            raise ValueError(f"special tokens must be non-empty strings, got {sorted(ids)}")
        self.ids = ids
        self._pattern = re.compile("|".join(map(re.escape, sorted(ids, key=len, reverse=True))))

    def encode(self, text: str, encode_plain: Callable[[str], List[int]]) -> List[int]:
        ids: List[int] = []
        start = 0
        for match in self._pattern.finditer(text):
            ids += encode_plain(text[start : match.start()])
            ids.append(self.ids[match.group()])
            start = match.end()
        return ids + encode_plain(text[start:])


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
    """A SentencePiece model; eod is its ``</s>`` piece, pad its pad piece (eod when it has none).
    With ``special_tokens_in_text="id"`` its control pieces (``<s>``, ``</s>``, ...) and ``<unk>``
    written in the text become their ids, as in the Hugging Face conversion of such a model."""

    def __init__(self, model_file: str, special_tokens_in_text: str = "text"):
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
            raise ConfigError(
                f"--tokenizer-model {model_file}: the model has no end-of-sentence piece "
                "(train it with an eos_id, as tools/train_tokenizer.py does)"
            )
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod
        self._specials = None
        if special_tokens_in_text == "id":
            self._specials = SpecialTokens(
                {
                    self._sp.IdToPiece(i): i
                    for i in range(self.vocab_size)
                    if self._sp.IsControl(i) or self._sp.IsUnknown(i)
                }
            )

    def encode(self, text: str) -> List[int]:
        if self._specials:
            return self._specials.encode(text, self._sp.EncodeAsIds)
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        if self._specials:
            return [self.encode(t) for t in texts]
        return self._sp.Encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``_Llama2Tokenizer``: Llama's ``encode(text, bos=True, eos=False)``, so every
    text starts with the bos piece; eod is ``</s>``, added only by ``--append-eod``."""

    def __init__(self, model_file: str, special_tokens_in_text: str = "text"):
        super().__init__(model_file, special_tokens_in_text)
        self.bos = self._sp.bos_id()
        if self.bos < 0:
            raise ConfigError(
                f"--tokenizer-model {model_file}: Llama2Tokenizer needs a model with a "
                "beginning-of-sentence piece (<s>); this one has none"
            )

    def encode(self, text: str) -> List[int]:
        return [self.bos] + super().encode(text)

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [[self.bos] + ids for ids in super().encode_batch(texts)]


class NullTokenizer:
    """Megatron-LM's ``NullTokenizer``: a text is its token ids written as decimal integers separated
    by single spaces; ``vocab_size`` ids, the last of them end-of-document (and padding)."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ConfigError(f"--vocab-size must be >= 2 for NullTokenizer, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = self.pad = vocab_size - 1

    def encode(self, text: str) -> List[int]:
        if not text:
            return []
        try:
            ids = [int(piece) for piece in text.split(" ")]
        except ValueError:
            raise TextEncodingError(
                f"NullTokenizer expects integers separated by single spaces, got {text[:40]!r}"
            ) from None
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise TextEncodingError(f"token id {bad} is outside [0, {self.vocab_size}) (--vocab-size)")
        return ids

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


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
    return dict(zip(bs, map(chr, cs), strict=True))


class GPT2BPETokenizer:
    """Byte-level BPE: split with GPT2_PATTERN, map bytes to characters, merge by rank.
    With ``special_tokens_in_text="id"`` a literal ``<|endoftext|>`` is the eod id."""

    def __init__(self, vocab_file: str, merge_file: str, special_tokens_in_text: str = "id"):
        import regex

        self.vocab_file, self.merge_file = vocab_file, merge_file
        try:
            self.encoder = read_json(vocab_file, ConfigError)
        except OSError as exc:
            raise ConfigError(f"--vocab-file {vocab_file}: cannot read a JSON vocabulary ({exc.strerror})") from None
        except ConfigError as exc:
            reason = str(exc).removeprefix(f"{vocab_file}: ")
            raise ConfigError(f"--vocab-file {vocab_file}: cannot read a JSON vocabulary ({reason})") from None
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
        self._specials = SpecialTokens({GPT2_EOD: self.eod}) if special_tokens_in_text == "id" else None

    def _bpe(self, word: str) -> List[str]:
        """Merge the lowest-ranked adjacent pair everywhere, until no known pair remains."""
        parts = list(word)
        ranks = self.bpe_ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:], strict=False):
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

    def _encode_plain(self, text: str) -> List[int]:
        ids: List[int] = []
        for token in self._pattern.findall(text):
            ids += self._cache.get(token) or self._encode_token(token)
        return ids

    def encode(self, text: str) -> List[int]:
        if self._specials:
            return self._specials.encode(text, self._encode_plain)
        return self._encode_plain(text)

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


# What a special token written in the text becomes by default: Megatron-LM's behaviour for the type.
DEFAULT_SPECIAL_TOKENS_IN_TEXT = {
    "GPT2BPETokenizer": "id",
    "HuggingFaceTokenizer": "id",
    "TikTokenizer": "id",
    "SentencePieceTokenizer": "text",
    "GPTSentencePieceTokenizer": "text",
    "Llama2Tokenizer": "text",
    "NullTokenizer": "text",
    "ByteTokenizer": "text",
}
TOKENIZER_TYPES = tuple(DEFAULT_SPECIAL_TOKENS_IN_TEXT)


def build_tokenizer(
    data_cfg: DataConfig,
    vocab_size: Optional[int] = None,
    special_tokens_in_text: Optional[str] = None,
    hf_add_special_tokens: bool = True,
):
    """The tokenizer ``data_cfg`` names; missing or unreadable files are ConfigErrors naming the flag.

    ``vocab_size`` is ``--vocab-size`` (NullTokenizer's only input; TikTokenizer's total). ``special_tokens_in_text``
    (``"id"``/``"text"``, default per type) and ``hf_add_special_tokens`` (False: Megatron's
    ``--tokenizer-hf-no-include-special-tokens``) change how text is encoded, not the vocabulary.
    """
    kind = data_cfg.tokenizer_type
    if kind not in DEFAULT_SPECIAL_TOKENS_IN_TEXT:
        raise ConfigError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}; got {kind!r}")
    specials = special_tokens_in_text or DEFAULT_SPECIAL_TOKENS_IN_TEXT[kind]
    if specials not in SPECIAL_TOKENS_IN_TEXT:
        raise ConfigError(
            f"--special-tokens-in-text must be one of {', '.join(SPECIAL_TOKENS_IN_TEXT)}; got {specials!r}"
        )
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_file("--vocab-file", data_cfg.vocab_file, kind),
            _require_file("--merge-file", data_cfg.merge_file, kind),
            specials,
        )
    if not data_cfg.tokenizer_model:
        raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(data_cfg.tokenizer_model, specials, hf_add_special_tokens)
    model = _require_file("--tokenizer-model", data_cfg.tokenizer_model, kind)
    if kind == "TikTokenizer":
        return TikTokenizer(
            model,
            data_cfg.tiktoken_pattern,
            vocab_size,
            data_cfg.tiktoken_num_special_tokens,
            data_cfg.tiktoken_special_tokens,
            specials,
        )
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(model, specials)
    return SentencePieceTokenizer(model, specials)
