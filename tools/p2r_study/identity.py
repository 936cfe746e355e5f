"""What a study's ``--work`` was built from, recorded in ``study.json``: the data given (its
resolved path and the SHA-256 of its bytes), the tokenizer, the held-out rule and the training
settings. A ``--work`` built from other data or settings is refused (its corpus, tokenizer and
runs would not belong to the new study), and every run's key includes this identity, so a
finished run is never reused for another corpus.

A jsonl is read here in fixed-size chunks, and a line longer than ``MAX_LINE_BYTES`` is refused
before any tool reads the file line by line (a 200 MB single-line file would otherwise be held
whole in memory, several times over, by the tokenizer and the preprocessor).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from typing import Optional

from tools.p2r_study.corpus import JSONL_SUFFIXES

FORMAT = 2  # study.json's layout; an older one is refused
CHUNK_BYTES = 1 << 22
MAX_LINE_BYTES = 64 << 20  # tools/preprocess_data.py's --max-line-bytes default


class IdentityError(ValueError):
    """A --work that belongs to another study, or data the study cannot read: one ``error:`` line."""


def _longest_line(path: str) -> tuple:
    """(bytes, 1-based number) of the longest line of a (gzipped) jsonl, read in chunks (bounded memory)."""
    import numpy as np

    opener = gzip.open if path.endswith(".gz") else open
    longest, number, run, seen = 0, 1, 0, 0  # seen: newlines before this chunk
    with opener(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
            if len(ends) == 0:
                run += len(chunk)
                continue
            lengths = np.diff(ends) - 1
            for length, line in (
                (run + int(ends[0]), seen + 1),
                *(((int(lengths.max()), seen + 2 + int(lengths.argmax())),) if len(lengths) else ()),
            ):
                if length > longest:
                    longest, number = length, line
            seen += len(ends)
            run = len(chunk) - int(ends[-1]) - 1
    return (run, seen + 1) if run > longest else (longest, number)


def _sha256(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def fingerprint(path: Optional[str], flag: str) -> Optional[dict]:
    """{"path", "sha256"} of a jsonl or a .bin/.idx prefix (None for None); a jsonl with a line
    over MAX_LINE_BYTES is refused."""
    if path is None:
        return None
    if path.endswith(JSONL_SUFFIXES):
        if not os.path.isfile(path):
            raise IdentityError(f"{flag} {path}: no such file")
        longest, line = _longest_line(path)
        if longest > MAX_LINE_BYTES:
            raise IdentityError(
                f"{flag} {path}: line {line} holds {longest:,} bytes; the study reads one document "
                f"per line of at most {MAX_LINE_BYTES:,} bytes: split it into documents"
            )
        files = [path]
    else:
        files = [path + ".bin", path + ".idx"]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise IdentityError(
                f"{flag} {missing[0]} not found: a data path is a .bin/.idx prefix or a {'/'.join(JSONL_SUFFIXES)} file"
            )
    return {"path": path, "sha256": _sha256(files)}


def study_identity(args) -> dict:
    """Everything that changes a run, from the options (paths absolute); the data hashed."""
    tokenizer_model = args.tokenizer_model
    if tokenizer_model and os.path.isfile(tokenizer_model):
        tokenizer_model = {"path": tokenizer_model, "sha256": _sha256([tokenizer_model])}
    data = fingerprint(args.data_path, "--data-path") or {"demo": args.demo_source, "bytes": args.corpus_bytes}
    return {
        "format": FORMAT,
        "data": data,
        "valid_data": fingerprint(args.valid_data_path, "--valid-data-path"),
        "tokenizer": [args.tokenizer_type, tokenizer_model],
        "held_out": None if args.valid_data_path else [args.held_out, args.valid_fraction, args.held_out_seed],
        "eval_samples": args.eval_samples,
        "iters": args.iters,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "eval_interval": args.eval_interval,
    }


def identity_key(identity: dict) -> str:
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]


def _data_mismatch(work: str, flag: str, old: Optional[dict], new: Optional[dict]) -> Optional[str]:
    if old == new:
        return None
    describe = lambda d: "the demo corpus" if d is None or "demo" in d else f"{d['path']} (sha256 {d['sha256'][:12]})"  # noqa: E731
    if old and new and old.get("path") == new.get("path"):
        return (
            f"--work {work} was built from {flag} {old['path']}, whose content has changed since "
            f"(sha256 {old['sha256'][:12]} -> {new['sha256'][:12]}); give another --work"
        )
    return (
        f"--work {work} was built from {describe(old)}, not from {flag} {describe(new)}: give another --work, "
        "or the data it was built from"
    )


def check(work: str, identity: dict, write_json, read_json) -> None:
    """Refuse a --work built from other data or settings; record the identity in a new one."""
    path = os.path.join(work, "study.json")
    if not os.path.exists(path):
        write_json(path, identity)
        return
    old = read_json(path)
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        raise IdentityError(
            f"--work {work} holds a study written by an older version of the study (no data "
            "fingerprint in its study.json); give another --work"
        )
    for key, flag in (("data", "--data-path"), ("valid_data", "--valid-data-path")):
        message = _data_mismatch(work, flag, old[key], identity[key])
        if message:
            raise IdentityError(message)
    changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in identity.items() if old.get(k) != v]
    if changed:
        raise IdentityError(
            f"--work {work} holds a study with other settings ({'; '.join(changed)}); "
            "give another --work or the same settings"
        )
