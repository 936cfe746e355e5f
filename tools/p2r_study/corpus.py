"""The study's corpus: the demo corpus, or the user's data (a Megatron ``.bin/.idx`` prefix, or a
jsonl the project's own ``tools/preprocess_data.py`` turns into one), and the held-out documents
every run is evaluated on.

The held-out set is ``--valid-data-path`` (all its documents; training then uses every document
of ``--data-path``), or ``--valid-fraction`` of ``--data-path``'s documents: by default a seeded
random sample of whole documents (``--held-out documents``), written with the rest as two
prefixes under ``--work`` so that no held-out document is trained on and a sorted corpus does
not hold out only its last topic; ``--held-out tail`` keeps Megatron-LM's ``--split`` rule
(the last contiguous documents) and copies nothing.

Every helper tool runs in the caller's directory with absolute paths: the study writes only
under ``--work``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DEMO_VOCAB = 4000
HELD_OUT_MODES = ("documents", "tail")
DEMO_NAMES = {
    "code": "the Python standard library's source code",
    "docs": "the Python reference topics and standard-library docstrings (English prose)",
}


class CorpusError(ValueError):
    """Bad corpus options or files: reported as one ``error:`` line."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where the study trains and evaluates, and with which tokenizer."""

    name: str  # for the report: the demo corpus's description or the data file's name
    tokenizer_type: str
    tokenizer_model: Optional[str]
    train_prefix: str
    split: str  # --split of the training runs
    valid_prefix: str
    valid_docs: Tuple[int, int]  # [begin, end) documents of valid_prefix held out
    held_out: str = "documents"  # how they were chosen: HELD_OUT_MODES or "given" (--valid-data-path)


def tool_env() -> dict:
    """The caller's environment with this checkout importable (``python -m tools.X`` from anywhere)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def _run_tool(module: str, *options: str) -> None:
    """``python -m module options`` in the caller's directory (never the checkout's); its summary on
    stdout is dropped, its progress and error line (stderr) are the user's."""
    done = subprocess.run([sys.executable, "-m", module, *options], env=tool_env(), stdout=subprocess.PIPE)
    if done.returncode:
        raise CorpusError(f"{module.replace('.', '/')}.py {' '.join(options)} failed (its error line is above)")


def open_indexed(prefix: str):
    """The IndexedDataset of ``prefix``; a missing or damaged file is a CorpusError naming it."""
    from megatron_p2r.data.indexed_dataset import IndexedDataset

    try:
        return IndexedDataset(prefix)
    except (ValueError, FileNotFoundError) as exc:
        raise CorpusError(str(exc)) from None


def _train_tokenizer(corpus: str, model_prefix: str) -> str:
    """A SentencePiece BPE of DEMO_VOCAB pieces on ``corpus`` (what the demo corpus uses)."""
    if not os.path.exists(model_prefix + ".model"):
        _run_tool(
            "tools.train_tokenizer",
            "--input",
            corpus,
            "--model-prefix",
            model_prefix,
            "--vocab-size",
            str(DEMO_VOCAB),
            "--model-type",
            "bpe",
            "--input-sentence-size",
            "200000",
        )
    return model_prefix + ".model"


def _indexed(path: str, out_prefix: str, tokenizer_type: str, tokenizer_model: Optional[str]) -> str:
    """``path`` as a ``.bin/.idx`` prefix: a jsonl is preprocessed (once) into ``out_prefix``."""
    if not path.endswith(JSONL_SUFFIXES):
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(path + suffix):
                raise CorpusError(
                    f"{path}{suffix} not found: a data path is a .bin/.idx prefix or a {'/'.join(JSONL_SUFFIXES)} file"
                )
        return path
    if not os.path.isfile(path):
        raise CorpusError(f"{path} not found")
    prefix = out_prefix + "_text_document"
    if not os.path.exists(prefix + ".idx"):
        options = ["--input", path, "--output-prefix", out_prefix, "--tokenizer-type", tokenizer_type, "--append-eod"]
        _run_tool(
            "tools.preprocess_data", *options, *(["--tokenizer-model", tokenizer_model] if tokenizer_model else [])
        )
    return prefix


def demo_jsonl(work: str, max_bytes: int, source: str) -> str:
    """The demo corpus of ``source`` (``tools/build_demo_corpus.py --source``)."""
    corpus = os.path.join(work, f"demo_{source}.jsonl")
    if not os.path.exists(corpus):
        _run_tool("tools.build_demo_corpus", "--output", corpus, "--max-bytes", str(max_bytes), "--source", source)
    return corpus


def prepare(args, work: str) -> Corpus:
    """The study's corpus from its options (paths absolute), preparing files under ``work`` when needed."""
    os.makedirs(work, exist_ok=True)
    data, name = args.data_path, args.data_path and os.path.basename(args.data_path)
    if data is None:
        data, name = demo_jsonl(work, args.corpus_bytes, args.demo_source), DEMO_NAMES[args.demo_source]
    tok_type, tok_model = args.tokenizer_type, args.tokenizer_model
    if tok_type is None:
        if not data.endswith(JSONL_SUFFIXES):
            raise CorpusError(
                f"--data-path {data} is tokenised already: give its --tokenizer-type (and --tokenizer-model)"
            )
        tok_type, tok_model = "SentencePieceTokenizer", _train_tokenizer(data, os.path.join(work, "tokenizer"))
    train = _indexed(data, os.path.join(work, "train"), tok_type, tok_model)
    documents = len(open_indexed(train))
    if args.valid_data_path:
        valid = _indexed(args.valid_data_path, os.path.join(work, "valid"), tok_type, tok_model)
        return Corpus(name, tok_type, tok_model, train, "100,0,0", valid, (0, len(open_indexed(valid))), "given")
    if not 0 < args.valid_fraction < 1:
        raise CorpusError(f"--valid-fraction must lie between 0 and 1, got {args.valid_fraction}")
    held_out = getattr(args, "held_out", "documents")
    if held_out == "tail":
        split = f"{1 - args.valid_fraction:.6g},{args.valid_fraction:.6g},0"
        return Corpus(name, tok_type, tok_model, train, split, train, _held_out_range(train, split, documents), "tail")
    count = round(args.valid_fraction * documents)
    if count < 1:
        raise CorpusError(
            f"--valid-fraction {args.valid_fraction:g} of {train}'s {documents} documents is no "
            "document: raise it or give --valid-data-path"
        )
    split_dir = os.path.join(work, f"split_{args.valid_fraction:g}_seed{args.held_out_seed}")
    kept, held = seeded_split(train, count, args.held_out_seed, split_dir)
    return Corpus(name, tok_type, tok_model, kept, "100,0,0", held, (0, count), "documents")


def held_out_documents(documents: int, count: int, seed: int):
    """The sorted ids of ``count`` of ``documents`` documents drawn without replacement with ``seed``."""
    import numpy as np

    return np.sort(np.random.default_rng(seed).choice(documents, size=count, replace=False))


def seeded_split(prefix: str, count: int, seed: int, out_dir: str) -> Tuple[str, str]:
    """``prefix``'s documents as two prefixes under ``out_dir``: the rest (in their order) and the
    ``count`` held out (``held_out_documents``); written once, the ``.idx`` last, so a killed
    study never finds half a split."""
    import numpy as np

    from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder

    kept, held = os.path.join(out_dir, "train"), os.path.join(out_dir, "heldout")
    if os.path.exists(kept + ".idx") and os.path.exists(held + ".idx"):
        return kept, held
    os.makedirs(out_dir, exist_ok=True)
    source = open_indexed(prefix)
    chosen = np.zeros(len(source), dtype=bool)
    chosen[held_out_documents(len(source), count, seed)] = True
    for out, wanted in ((held, True), (kept, False)):
        builder = IndexedDatasetBuilder(out + ".bin.tmp", dtype=source.dtype)
        for i in np.flatnonzero(chosen == wanted):
            builder.add_document(source[int(i)])
        builder.finalize(out + ".idx.tmp")
        os.replace(out + ".bin.tmp", out + ".bin")
        os.replace(out + ".idx.tmp", out + ".idx")
    return kept, held


def _held_out_range(prefix: str, split: str, documents: int) -> Tuple[int, int]:
    """The documents the training runs' ``--split`` leaves to validation."""
    from megatron_p2r.config.data import parse_split
    from megatron_p2r.data.builder import split_ranges

    begin, end = split_ranges(parse_split(split), documents)[1]
    if begin == end:
        raise CorpusError(
            f"--valid-fraction {split.split(',')[1]} of {prefix}'s {documents} documents is "
            "no document: raise it or give --valid-data-path"
        )
    return begin, end
