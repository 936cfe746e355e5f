"""``--tokenizer-type TikTokenizer``: Megatron-LM's tiktoken tokenizer (core_v0.16.1, the
``megatron.core.tokenizers`` one its ``tools/preprocess_data.py`` and training build by default).

The vocabulary file (``--tokenizer-model``) is Megatron's JSON list of ``{"rank", "token_bytes"
(base64), "token_str"}``, rank i at position i, the first 256 the single bytes. Ids: the first
``--tiktoken-num-special-tokens`` ids are special tokens, the named ones
(``--tiktoken-special-tokens``, default the seven below) in their order, then ``<SPECIAL_i>``
fillers; vocabulary rank r is id r + num_special_tokens, and the vocabulary is cut so that the
total is ``--vocab-size`` (Megatron's default 131072). eod = ``</s>``, bos = ``<s>``, pad = ``<pad>``.
Encoding is ``tiktoken``'s own, with Megatron's v1/v2 split patterns; a special token written in
the text is its id (Megatron's ``allowed_special="all"``), or text with ``special_tokens_in_text="text"``
(Megatron's legacy tokenizer's ``encode_ordinary``).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_p2r.config import ConfigError

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_PATTERN = "v2"
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
FILLER = "<SPECIAL_{}>"


def read_ranks(path: str, max_tokens: int) -> Dict[bytes, int]:
    """Token bytes -> rank of the first ``max_tokens`` entries of a Megatron tiktoken vocabulary."""
    flag = f"--tokenizer-model {path}"
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"{flag}: not a JSON tiktoken vocabulary ({exc})") from None
    if not isinstance(entries, list):
        raise ConfigError(f"{flag}: expected a JSON list of {{rank, token_bytes, token_str}} (Megatron's format)")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_tokens]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise ConfigError(f'{flag}: entry {i} is not {{"rank": {i}, "token_bytes", "token_str"}}')
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError):
            raise ConfigError(f"{flag}: entry {i}: token_bytes is not base64") from None
        if (i < 256 and token != bytes([i])) or token in ranks:
            raise ConfigError(
                f"{flag}: entry {i}: token {token!r} is "
                + ("repeated" if token in ranks else f"not the single byte {i}")
            )
        ranks[token] = i
    return ranks


def special_token_list(named: Optional[Sequence[str]], count: int, vocab_size: int) -> List[str]:
    """The ``count`` special tokens, ids 0..count-1: the named ones, then ``<SPECIAL_i>`` fillers."""
    named = list(REQUIRED_SPECIAL_TOKENS if named is None else named)
    if len(set(named)) != len(named):
        raise ConfigError(f"--tiktoken-special-tokens must be unique, got {named}")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in named]
    if missing:
        raise ConfigError(
            f"--tiktoken-special-tokens must include {' '.join(REQUIRED_SPECIAL_TOKENS)}; missing {' '.join(missing)}"
        )
    if not len(named) <= count < vocab_size:
        raise ConfigError(
            f"--tiktoken-num-special-tokens {count} must be >= the {len(named)} named special tokens "
            f"and < --vocab-size {vocab_size}"
        )
    tokens = named + [FILLER.format(i) for i in range(len(named), count)]
    if len(set(tokens)) != count:
        raise ConfigError(f"--tiktoken-special-tokens: a name clashes with a filler {FILLER.format('i')}")
    return tokens


class TikTokenizer:
    """Megatron's TikTokenizer; vocab_size, eod, pad, bos, encode, decode as the other tokenizers."""

    def __init__(
        self,
        vocab_file: str,
        pattern: Optional[str] = None,
        vocab_size: Optional[int] = None,
        num_special_tokens: Optional[int] = None,
        special_tokens: Optional[Sequence[str]] = None,
        special_tokens_in_text: str = "id",
    ):
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(
                "--tokenizer-type TikTokenizer needs the tiktoken package: pip install megatron_p2r[tiktoken]"
            ) from None
        pattern = pattern or DEFAULT_PATTERN
        if pattern not in PATTERNS:
            raise ConfigError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        self.vocab_file, self.pattern = vocab_file, pattern
        self.vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        self.num_special_tokens = DEFAULT_NUM_SPECIAL_TOKENS if num_special_tokens is None else num_special_tokens
        self.special_tokens = special_token_list(special_tokens, self.num_special_tokens, self.vocab_size)
        inner = self.vocab_size - self.num_special_tokens
        ranks = read_ranks(vocab_file, inner)
        if len(ranks) < inner:
            raise ConfigError(
                f"--tokenizer-model {vocab_file} holds {len(ranks)} tokens, fewer than --vocab-size "
                f"{self.vocab_size} - --tiktoken-num-special-tokens {self.num_special_tokens}: "
                f"pass --vocab-size {len(ranks) + self.num_special_tokens} or less"
            )
        self.ranks = {token: rank + self.num_special_tokens for token, rank in ranks.items()}
        self.special_ids = {token: i for i, token in enumerate(self.special_tokens)}
        self.encoding = tiktoken.Encoding(
            name="megatron_tiktoken",
            pat_str=PATTERNS[pattern],
            mergeable_ranks=self.ranks,
            special_tokens=self.special_ids,
        )
        self.eod = self.special_ids["</s>"]
        self.bos = self.special_ids["<s>"]
        self.pad = self.special_ids["<pad>"]
        self.unk = self.special_ids["<unk>"]
        self._specials_as_ids = special_tokens_in_text == "id"

    def encode(self, text: str) -> List[int]:
        if self._specials_as_ids:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])
