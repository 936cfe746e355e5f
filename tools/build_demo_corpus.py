"""Write a jsonl corpus from the Python standard library: its source (one document per ``.py``
file) or, with ``--source docs``, its English documentation.

    python tools/build_demo_corpus.py --output demo_out/corpus.jsonl --max-bytes 20000000 [--source docs]

Every machine with Python has this text (under the Python Software Foundation License), so
demos and tests get real, varied text without a download. ``code``: files in sorted order of
their path under ``sysconfig``'s stdlib directory (installed packages in site-packages
excluded), so the same Python gives the same corpus; files that are not UTF-8 are skipped.
``docs``: natural-language text, unlike the code: first the reference manual's topics that
``help()`` shows (``pydoc_data.topics``, one document each, in sorted order), then per module
(same order, test packages left out) its docstrings, module, classes and functions, that are
longer than a line, joined by blank lines. Each line is ``{"text": ..., "path": ...}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
from typing import Iterator, List, Optional, Sequence

from megatron_p2r.cli import run_tool
from megatron_p2r.config import ConfigError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
MIN_DOCSTRING_CHARS = 80  # a one-line docstring says little as text


def stdlib_paths(root: str, excluded=frozenset()) -> List[str]:
    """Every ``.py`` file under ``root`` (relative, '/'-separated), sorted."""
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS and d not in excluded]
        paths += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
    return sorted(p.replace(os.sep, "/") for p in paths)


def stdlib_sources(root: str, excluded=frozenset()) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``.py`` file under ``root``, sorted by path."""
    for rel in stdlib_paths(root, excluded):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                yield rel, f.read()
        except (UnicodeDecodeError, OSError):
            continue


def stdlib_docs(root: str) -> Iterator[tuple[str, str]]:
    """(name, text) of the reference manual's topics, then of each module's docstrings."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc_data/topics/{name}", topics[name]
    for rel, source in stdlib_sources(root, TEST_DIRS):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        nodes = (
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        )
        texts = [t for t in (ast.get_docstring(n) for n in nodes) if t and len(t) >= MIN_DOCSTRING_CHARS]
        if texts:
            yield rel, "\n\n".join(texts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--max-docs", type=int, help="stop after this many documents")
    p.add_argument("--max-bytes", type=int, help="stop before the text exceeds this many UTF-8 bytes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--source",
        choices=("code", "docs"),
        default="code",
        help="code: the .py files; docs: the reference topics and the modules' docstrings (English text)",
    )
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
        for rel, text in (stdlib_docs if args.source == "docs" else stdlib_sources)(root):
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
