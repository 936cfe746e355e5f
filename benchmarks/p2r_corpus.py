"""The convergence study's corpus: the demo corpus, or the user's data (a Megatron ``.bin/.idx``
prefix, or a jsonl the project's own ``tools/preprocess_data.py`` turns into one), and the
held-out documents every run is evaluated on.

The held-out set is either ``--valid-data-path`` (all its documents; training then uses every
document of ``--data-path``) or the last ``--valid-fraction`` of ``--data-path``'s documents
(Megatron-LM's ``--split`` rule: contiguous document ranges, so no held-out document is
trained on).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DEMO_VOCAB = 4000


class CorpusError(ValueError):
    """Bad corpus options or files: reported as one ``error:`` line."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where the study trains and evaluates, and with which tokenizer."""

    name: str                      # for the report: the demo corpus's description or the --data-path given
    tokenizer_type: str
    tokenizer_model: Optional[str]
    train_prefix: str
    split: str                     # --split of the training runs
    valid_prefix: str
    valid_docs: Tuple[int, int]    # [begin, end) documents of valid_prefix held out


def _run_tool(script: str, *options: str) -> None:
    done = subprocess.run([sys.executable, script, *options], cwd=ROOT, stdout=subprocess.DEVNULL)
    if done.returncode:
        raise CorpusError(f"{script} {' '.join(options)} failed (its error line is above)")


def _train_tokenizer(corpus: str, model_prefix: str) -> str:
    """A SentencePiece BPE of DEMO_VOCAB pieces on ``corpus`` (what the demo corpus uses)."""
    if not os.path.exists(model_prefix + ".model"):
        _run_tool("tools/train_tokenizer.py", "--input", corpus, "--model-prefix", model_prefix, "--vocab-size",
                  str(DEMO_VOCAB), "--model-type", "bpe", "--input-sentence-size", "200000")
    return model_prefix + ".model"


def _indexed(path: str, out_prefix: str, tokenizer_type: str, tokenizer_model: Optional[str]) -> str:
    """``path`` as a ``.bin/.idx`` prefix: a jsonl is preprocessed (once) into ``out_prefix``."""
    if not path.endswith(JSONL_SUFFIXES):
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(path + suffix):
                raise CorpusError(f"{path}{suffix} not found: a data path is a .bin/.idx prefix or a "
                                  f"{'/'.join(JSONL_SUFFIXES)} file")
        return path
    if not os.path.isfile(path):
        raise CorpusError(f"{path} not found")
    prefix = out_prefix + "_text_document"
    if not os.path.exists(prefix + ".idx"):
        options = ["--input", path, "--output-prefix", out_prefix, "--tokenizer-type", tokenizer_type, "--append-eod"]
        _run_tool("tools/preprocess_data.py", *options, *(["--tokenizer-model", tokenizer_model]
                                                          if tokenizer_model else []))
    return prefix


DEMO_NAMES = {"code": "the Python standard library's source code",
              "docs": "the Python reference topics and standard-library docstrings (English prose)"}


def demo_jsonl(work: str, max_bytes: int, source: str) -> str:
    """The demo corpus of ``source`` (``tools/build_demo_corpus.py --source``)."""
    corpus = os.path.join(work, f"demo_{source}.jsonl")
    if not os.path.exists(corpus):
        _run_tool("tools/build_demo_corpus.py", "--output", corpus, "--max-bytes", str(max_bytes), "--source", source)
    return corpus


def prepare(args, work: str) -> Corpus:
    """The study's corpus from its options, preparing files under ``work`` when needed."""
    os.makedirs(work, exist_ok=True)
    data, name = args.data_path, args.data_path
    if data is None:
        data, name = demo_jsonl(work, args.corpus_bytes, args.demo_source), DEMO_NAMES[args.demo_source]
    tok_type, tok_model = args.tokenizer_type, args.tokenizer_model
    if tok_type is None:
        if not data.endswith(JSONL_SUFFIXES):
            raise CorpusError(f"--data-path {data} is tokenised already: give its --tokenizer-type (and "
                              "--tokenizer-model)")
        tok_type, tok_model = "SentencePieceTokenizer", _train_tokenizer(data, os.path.join(work, "tokenizer"))
    train = _indexed(data, os.path.join(work, "train"), tok_type, tok_model)
    if args.valid_data_path:
        valid = _indexed(args.valid_data_path, os.path.join(work, "valid"), tok_type, tok_model)
        return Corpus(name, tok_type, tok_model, train, "100,0,0", valid, (0, _documents(valid)))
    if not 0 < args.valid_fraction < 1:
        raise CorpusError(f"--valid-fraction must lie between 0 and 1, got {args.valid_fraction}")
    split = f"{1 - args.valid_fraction:.6g},{args.valid_fraction:.6g},0"
    return Corpus(name, tok_type, tok_model, train, split, train, _held_out_range(train, split))


def _documents(prefix: str) -> int:
    from megatron_p2r.data.indexed_dataset import IndexedDataset
    return len(IndexedDataset(prefix))


def _held_out_range(prefix: str, split: str) -> Tuple[int, int]:
    """The documents the training runs' ``--split`` leaves to validation."""
    from megatron_p2r.config.data import parse_split
    from megatron_p2r.data.builder import split_ranges
    begin, end = split_ranges(parse_split(split), _documents(prefix))[1]
    if begin == end:
        raise CorpusError(f"--valid-fraction {split.split(',')[1]} of {prefix}'s {_documents(prefix)} documents is "
                          "no document: raise it or give --valid-data-path")
    return begin, end
