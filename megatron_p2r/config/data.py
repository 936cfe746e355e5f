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
    data_args_path: Optional[str] = opt(
        None, "A text file holding what --data-path would (whitespace-separated prefixes, optionally weighted)."
    )
    train_data_path: Optional[List[str]] = opt(
        None, "The training split's own prefixes, optionally weighted (instead of --data-path with --split).", nargs="+"
    )
    valid_data_path: Optional[List[str]] = opt(None, "The validation split's own prefixes.", nargs="+")
    test_data_path: Optional[List[str]] = opt(None, "The test split's own prefixes.", nargs="+")
    per_split_data_args_path: Optional[str] = opt(
        None,
        'A JSON file {"train": ..., "valid": ..., "test": ...} of each split\'s prefixes (a list, a string or null).',
    )
    dataloader_type: Optional[str] = opt(
        None,
        "single: the samples in the dataset's order, from where the run "
        "left off (Megatron-LM's default; cyclic and external are not built).",
        choices=["single"],
    )
    mock_data: bool = opt(False, "Deterministic synthetic data (no files).")
    data_cache_path: Optional[str] = opt(None, "Where index caches go (default beside the data).")
    tokenizer_type: Optional[str] = opt(
        None,
        "Tokenizer (docs/data.md).",
        choices=[
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            "TikTokenizer",
            "NullTokenizer",
            "ByteTokenizer",
        ],
    )
    tokenizer_model: Optional[str] = opt(
        None,
        "SentencePiece .model; HuggingFaceTokenizer: a directory with "
        "tokenizer.json, or that file; TikTokenizer: Megatron's JSON vocabulary.",
    )
    vocab_file: Optional[str] = opt(None, "GPT-2 BPE vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT-2 BPE merges.txt.")
    tiktoken_pattern: Optional[str] = opt(
        None, "TikTokenizer's split pattern (Megatron's; default v2).", choices=["v1", "v2"]
    )
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids 0..N-1 are special tokens.")
    tiktoken_special_tokens: Optional[List[str]] = opt(
        None,
        "TikTokenizer's named special tokens, ids from 0 (default <unk> <s> </s> <mask> <pad> <cls> <sep>).",
        nargs="+",
    )

    @property
    def per_split(self) -> bool:
        """Each split has its own prefixes (Megatron-LM's blend_per_split)."""
        return self.per_split_data_args_path is not None or any(
            paths is not None for paths in (self.train_data_path, self.valid_data_path, self.test_data_path)
        )

    @property
    def has_files(self) -> bool:
        """Some data flag names files to read."""
        return bool(self.data_path) or self.data_args_path is not None or self.per_split

    def check(self) -> None:
        given = [
            flag
            for flag, on in (
                ("--data-path", self.data_path),
                ("--data-args-path", self.data_args_path),
                ("per-split paths", self.per_split),
            )
            if on
        ]
        if self.mock_data and given:
            raise ConfigError(f"--mock-data and {given[0]} are mutually exclusive (--mock-data would ignore the data)")
        if len(given) > 1:  # Megatron-LM would take the first and silently ignore the other
            raise ConfigError(f"{given[0]} and {given[1]} are mutually exclusive: give the data one way")
        if self.per_split_data_args_path is not None and any(
            paths is not None for paths in (self.train_data_path, self.valid_data_path, self.test_data_path)
        ):
            raise ConfigError("--per-split-data-args-path and --train/valid/test-data-path are mutually exclusive")
        parse_split(self.split)  # also with --mock-data: a typo fails now, not when data files are added


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


RANGES = {"tiktoken_num_special_tokens": at_least(7, 2**24)}  # Megatron's 7 named special tokens
