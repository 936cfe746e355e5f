"""The data section: dataset prefixes or mock data, and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_p2r.config.fields import ConfigError, opt


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[List[str]] = opt(None, "Dataset prefixes, optionally weighted: 0.3 A 0.7 B.", nargs="+")
    split: str = opt("969,30,1", "Train,valid,test proportions.")
    mock_data: bool = opt(False, "Deterministic synthetic data (no files).")
    data_cache_path: Optional[str] = opt(None, "Where index caches go (default beside the data).")
    tokenizer_type: Optional[str] = opt(None, "Tokenizer (docs/data.md).", choices=[
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
        "HuggingFaceTokenizer", "NullTokenizer", "ByteTokenizer"])
    tokenizer_model: Optional[str] = opt(None, "SentencePiece .model; HuggingFaceTokenizer: a directory with "
                                         "tokenizer.json, or that file.")
    vocab_file: Optional[str] = opt(None, "GPT-2 BPE vocab.json.")
    merge_file: Optional[str] = opt(None, "GPT-2 BPE merges.txt.")

    def check(self) -> None:
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are mutually exclusive (--mock-data would ignore the data)")


# No numeric fields: the type checks of config/ranges.py cover the section.
RANGES: dict = {}
