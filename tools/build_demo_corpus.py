"""Write a jsonl corpus of the Python standard library's source: one document per ``.py`` file.

    python tools/build_demo_corpus.py --output demo_out/corpus.jsonl --max-bytes 20000000

Every machine with Python has this text, so demos and tests get real, varied text without a
download. Files are taken in sorted order of their path under ``sysconfig``'s stdlib
directory (installed packages in site-packages excluded), so the same Python gives the same
corpus. Each line is ``{"text": ..., "path": ...}``; files that are not UTF-8 are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from typing import Iterator, Optional, Sequence

from megatron_p2r.cli import run_tool
from megatron_p2r.config import ConfigError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(root: str) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``.py`` file under ``root``, sorted by path."""
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        paths += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
    for rel in sorted(p.replace(os.sep, "/") for p in paths):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                yield rel, f.read()
        except (UnicodeDecodeError, OSError):
            continue


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--max-docs", type=int, help="stop after this many documents")
    p.add_argument("--max-bytes", type=int, help="stop before the text exceeds this many UTF-8 bytes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = p.parse_args(argv)
    return run_tool(lambda: build(args))


def build(args) -> int:
    if os.path.exists(args.output) and not args.overwrite:
        raise ConfigError(f"{args.output} already exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    docs = total = 0
    tmp = f"{args.output}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out:
        for rel, text in stdlib_sources(root):
            if args.max_docs is not None and docs >= args.max_docs:
                break
            size = len(text.encode("utf-8"))
            if args.max_bytes is not None and total + size > args.max_bytes:
                break
            out.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
            docs += 1
            total += size
    os.replace(tmp, args.output)
    print(f"wrote {docs} documents ({total:,} bytes of text) from {root} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
