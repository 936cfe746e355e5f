"""The data section: dataset prefixes or mock data, and the tokenizer."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import at_least


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[List[str]] = opt(None, "Dataset prefixes, optionally weighted: 0.3 A 0.7 B.", nargs="+")
    split: str = opt("969,30,1", "Train,valid,test proportions.")
    mock_data: bool = opt(False, "Deterministic synthetic data (no files).")
    data_cache_path: Optional[str] = opt(None, "Where index caches go (default beside the data).")
    tokenizer_type: Optional[str] = opt(None, "Tokenizer (docs/data.md).", choices=[
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
        "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer", "ByteTokenizer"])
    tokenizer_model: Optional[str] = opt(None, "SentencePiece .model; HuggingFaceTokenizer: a directory with "
                                         "tokenizer.json, or that file; TikTokenizer: Megatron's JSON vocabulary.")
    vocab_file: Optional[str] = opt(None, "GPT-2 BPE vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT-2 BPE merges.txt.")
    tiktoken_pattern: Optional[str] = opt(None, "TikTokenizer's split pattern (Megatron's; default v2).",
                                          choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids 0..N-1 are special tokens.")
    tiktoken_special_tokens: Optional[List[str]] = opt(None, "TikTokenizer's named special tokens, ids from 0 "
                                                       "(default <unk> <s> </s> <mask> <pad> <cls> <sep>).", nargs="+")

    def check(self) -> None:
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are mutually exclusive (--mock-data would ignore the data)")
        parse_split(self.split)   # also with --mock-data: a typo fails now, not when data files are added


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` (or ``969/30/1``) -> normalised [train, valid, test] fractions. Quotes
    around it are ignored, as Megatron-LM reads only the numbers: a launch script that writes
    ``"--split '99,1,0'"`` in a bash array passes them on literally."""
    try:
        parts = [float(s) for s in split.strip().strip("'\"").replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, got {split!r}") from None
    if len(parts) > 3 or not all(0 <= p < math.inf for p in parts) or not 0 < sum(parts) < math.inf:
        raise ConfigError(f"--split takes up to 3 finite non-negative numbers with a positive sum, got {split!r}")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


RANGES = {"tiktoken_num_special_tokens": at_least(7, 2 ** 24)}  # Megatron's 7 named special tokens
