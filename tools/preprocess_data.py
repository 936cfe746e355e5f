"""Tokenise a jsonl corpus into Megatron-LM indexed datasets (``PREFIX_KEY_document.bin/.idx``).

    p2r-preprocess-data --input corpus.jsonl.gz --json-keys text --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --workers 8 --append-eod

The input is streamed in chunks of lines; worker processes parse and tokenise them while the
main process writes the results in input order, so any worker count gives identical files.
Lines that are not a JSON object with a string under every key are skipped and reported with
their line numbers (``--strict`` stops at the first). A text of no tokens is, as in
Megatron-LM, a document with no sequence (and no eod), so later samples are not shifted.
Outputs are written under temporary names and renamed when complete; existing outputs are
kept unless ``--overwrite``. An input that yields no document at all (empty, binary, or not
jsonl) is an error and writes nothing; a line longer than ``--max-line-bytes`` is a bad line,
read past in bounded blocks, never held whole. Exit status: 0 done, 2 bad input (one
``error:`` line), 1 an OS error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import multiprocessing
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as `python tools/preprocess_data.py`: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from tqdm import tqdm

from megatron_p2r.cli import run_tool
from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_p2r.data.tokenizers import SPECIAL_TOKENS_IN_TEXT, TOKENIZER_TYPES, TextEncodingError, build_tokenizer

MAX_REPORTED_BAD_LINES = 10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="jsonl file, optionally .gz; one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenise; one output per key")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument(
        "--tokenizer-model",
        help="SentencePiece .model; HuggingFaceTokenizer: a directory with "
        "tokenizer.json, or that file; TikTokenizer: Megatron's JSON vocabulary",
    )
    p.add_argument("--vocab-file", help="GPT-2 BPE vocab.json")
    p.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="NullTokenizer: number of ids (eod is the last); "
        "TikTokenizer: ids in all (default 131072, as Megatron-LM)",
    )
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer's split pattern (default v2)")
    p.add_argument(
        "--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer: ids 0..N-1 are special tokens"
    )
    p.add_argument("--tiktoken-special-tokens", nargs="+", help="TikTokenizer's named special tokens, ids from 0")
    p.add_argument(
        "--special-tokens-in-text",
        choices=SPECIAL_TOKENS_IN_TEXT,
        help="a special token written in the text (<|endoftext|>, </s>) becomes its id, or is "
        "encoded as text; default: Megatron-LM's behaviour for the tokenizer type (docs/data.md)",
    )
    p.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="HuggingFaceTokenizer: leave out the post-processor's special tokens (e.g. a bos)",
    )
    p.add_argument(
        "--append-eod", action="store_true", help="end every document that has tokens with the end-of-document token"
    )
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (1: in this process)")
    p.add_argument("--chunk-lines", type=int, default=64, help="lines per task sent to a worker")
    p.add_argument("--strict", action="store_true", help="fail on the first bad line instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument(
        "--max-line-bytes",
        type=int,
        default=64 * 2**20,
        help="longer lines are bad lines, skipped without being read whole",
    )
    return p


@dataclass
class Stats:
    documents: int = 0
    empty_documents: int = 0  # texts of no tokens, counted per key: documents without a sequence
    tokens: int = 0
    seconds: float = 0.0
    bad_lines: List[tuple] = field(default_factory=list)  # (line number, reason), at most MAX_REPORTED_BAD_LINES
    num_bad_lines: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# Per-process state of the tokenising workers (set once by _init_worker).
_worker: dict = {}


def _set_worker(tokenizer, keys: Sequence[str], append_eod: bool, dtype: str) -> None:
    _worker.update(tokenizer=tokenizer, keys=list(keys), append_eod=append_eod, dtype=np.dtype(dtype))


def _init_worker(data_cfg: DataConfig, tokenizer_options: dict, *rest) -> None:
    _set_worker(build_tokenizer(data_cfg, **tokenizer_options), *rest)


def _encode_line(line: bytes):
    """(token bytes per key) for a good line, or the reason it is bad."""
    if line == TOO_LONG:
        return "longer than --max-line-bytes"
    try:
        doc = json.loads(line)
    except UnicodeDecodeError:
        return "not UTF-8"
    except ValueError as exc:
        return f"invalid JSON ({exc})"
    except RecursionError:
        return "invalid JSON (nested too deeply)"
    if not isinstance(doc, dict):
        return f"expected a JSON object, got {type(doc).__name__}"
    texts = []
    for key in _worker["keys"]:
        if key not in doc:
            return f"missing key {key!r}"
        if not isinstance(doc[key], str):
            return f"key {key!r} holds {type(doc[key]).__name__}, expected a string"
        texts.append(doc[key])
    tokenizer = _worker["tokenizer"]
    try:
        encoded = tokenizer.encode_batch(texts)
    except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800" is valid JSON, not text
        return f"text is not encodable as UTF-8 ({exc.reason} at position {exc.start})"
    except TextEncodingError as exc:
        return str(exc)
    out = []
    for ids in encoded:
        if _worker["append_eod"] and len(ids):  # Megatron-LM: an empty document gets no eod either
            ids = list(ids) + [tokenizer.eod]
        out.append(np.asarray(ids, dtype=_worker["dtype"]).tobytes())
    return out


def _encode_chunk(chunk):
    return [(number, _encode_line(line)) for number, line in chunk]


def _lines(f, limit: int):
    """The lines of ``f``; a line longer than ``limit`` bytes is read past in blocks and yielded as
    TOO_LONG, so memory never holds more than ``limit`` bytes of one line."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := f.readline(limit)) and not rest.endswith(b"\n"):
                pass
            line = TOO_LONG
        yield line


TOO_LONG = b"\x00too long"  # never a valid JSON line


def _read_chunks(path: str, chunk_lines: int, max_line_bytes: int):
    """Lists of (line number, line), streamed; whitespace-only lines are dropped."""
    opener = gzip.open if path.endswith(".gz") else open
    chunk = []
    with opener(path, "rb") as f:
        for number, line in enumerate(_lines(f, max_line_bytes), 1):
            if line.strip():
                chunk.append((number, line))
                if len(chunk) == chunk_lines:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _results(args, data_cfg: DataConfig, tokenizer_options: dict, tokenizer, dtype: np.dtype):
    """Encoded chunks in input order; at most a few chunks per worker are in flight (bounded memory)."""
    chunks = _read_chunks(args.input, args.chunk_lines, args.max_line_bytes)
    settings = (args.json_keys, args.append_eod, dtype.str)
    if args.workers <= 1:
        _set_worker(tokenizer, *settings)
        for chunk in chunks:
            yield _encode_chunk(chunk)
        return
    initargs = (data_cfg, tokenizer_options, *settings)
    with multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, initargs) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 4 * args.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_paths(prefix: str, key: str) -> tuple[str, str]:
    return f"{prefix}_{key}_document.bin", f"{prefix}_{key}_document.idx"


def _create_new(path: str) -> None:
    """Create ``path`` as a new empty file of this user, never writing through a link or file
    planted at that (predictable) temporary name: it is removed first, then created exclusively."""
    if os.path.lexists(path):
        os.unlink(path)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666))


def preprocess(args) -> Stats:
    """Run the conversion described by parsed ``args``; bad input is a ConfigError naming it."""
    if args.workers < 1 or args.chunk_lines < 1 or args.max_line_bytes < 1:
        raise ConfigError("--workers, --chunk-lines and --max-line-bytes must be >= 1")
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input}: no such file")
    data_cfg = DataConfig(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
    )
    tokenizer_options = dict(
        vocab_size=args.vocab_size,
        special_tokens_in_text=args.special_tokens_in_text,
        hf_add_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
    )
    tokenizer = build_tokenizer(data_cfg, **tokenizer_options)
    if args.append_eod and tokenizer.eod is None:
        raise ConfigError(
            f"--append-eod: --tokenizer-model {args.tokenizer_model} names no eos token; add "
            '"eos_token" to the tokenizer_config.json beside its tokenizer.json'
        )
    outputs = [output_paths(args.output_prefix, key) for key in args.json_keys]
    existing = [p for pair in outputs for p in pair if os.path.lexists(p)]  # a dangling link counts
    if existing and not args.overwrite:
        raise ConfigError(f"{existing[0]} already exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = np.dtype(best_dtype(tokenizer.vocab_size))
    tmp = [(f"{b}.tmp{os.getpid()}", f"{i}.tmp{os.getpid()}") for b, i in outputs]
    for path in (p for pair in tmp for p in pair):
        _create_new(path)
    builders = [IndexedDatasetBuilder(b, dtype) for b, _ in tmp]
    stats = Stats()
    start = time.perf_counter()
    try:
        try:
            with (
                tqdm(unit=" docs", disable=None, desc="tokenising") as bar,
                contextlib.closing(_results(args, data_cfg, tokenizer_options, tokenizer, dtype)) as chunks,
            ):
                for results in chunks:
                    for line_number, result in results:
                        if isinstance(result, str):
                            if args.strict:
                                raise ConfigError(f"{args.input}:{line_number}: {result}")
                            stats.num_bad_lines += 1
                            if len(stats.bad_lines) < MAX_REPORTED_BAD_LINES:
                                stats.bad_lines.append((line_number, result))
                            continue
                        for builder, data in zip(builders, result, strict=True):
                            tokens = np.frombuffer(data, dtype)
                            if len(tokens):
                                builder.add_item(tokens)
                            else:  # as Megatron-LM's add_document(tokens, lengths=[]): no sequence
                                stats.empty_documents += 1
                            builder.end_document()
                            stats.tokens += len(tokens)
                        stats.documents += 1
                    bar.update(len(results))
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # a truncated or fake .gz input
            raise ConfigError(f"--input {args.input}: cannot decompress it ({exc}); nothing was written") from None
        if stats.documents == 0:
            raise ConfigError(_no_document(args.input, stats))
        for builder, (_, idx) in zip(builders, tmp, strict=True):
            builder.finalize(idx)
        for (b_tmp, i_tmp), (b, i) in zip(tmp, outputs, strict=True):
            os.replace(b_tmp, b)
            os.replace(i_tmp, i)
    finally:
        for path in (p for pair in tmp for p in pair):
            if os.path.exists(path):
                os.unlink(path)
    stats.seconds = time.perf_counter() - start
    return stats


def _no_document(path: str, stats: Stats) -> str:
    """Why an input gave no document: empty, or every line bad (binary, not jsonl, wrong keys)."""
    if not stats.num_bad_lines:
        return f"--input {path}: no text in it (empty, or only blank lines); nothing was written"
    shown = "; ".join(f"line {n}: {why}" for n, why in stats.bad_lines[:3])
    return (
        f"--input {path}: none of its {stats.num_bad_lines} non-blank lines is a JSON object with the "
        f"--json-keys as strings ({shown}); is it jsonl? nothing was written"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: _report(args, preprocess(args)))


def _report(args, stats: Stats) -> int:
    for _, idx in (output_paths(args.output_prefix, key) for key in args.json_keys):
        print(f"wrote {idx[:-4]}.bin/.idx")
    print(
        f"documents: {stats.documents}, tokens: {stats.tokens}, time: {stats.seconds:.2f}s, "
        f"tokens/s: {stats.tokens_per_second:,.0f} ({args.workers} worker(s))"
    )
    if stats.empty_documents:
        print(f"empty texts: {stats.empty_documents}, written as documents with no sequence (as Megatron-LM does)")
    if stats.num_bad_lines:
        shown = "; ".join(f"line {n}: {why}" for n, why in stats.bad_lines)
        more = f" (first {len(stats.bad_lines)} shown)" if stats.num_bad_lines > len(stats.bad_lines) else ""
        print(f"skipped {stats.num_bad_lines} bad line(s){more}: {shown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
