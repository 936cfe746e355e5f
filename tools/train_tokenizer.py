"""Train a SentencePiece model (BPE or unigram) for ``--tokenizer-type SentencePieceTokenizer``.

    p2r-train-tokenizer --input corpus.jsonl --json-keys text --model-prefix tok/m6 \\
        --vocab-size 32000 --model-type bpe

Inputs are jsonl (``.jsonl``/``.json``, optionally ``.gz``: the ``--json-keys`` fields) or
plain text (any other name: every line), read as a stream and fed to SentencePiece line by
line; SentencePiece keeps a random sample of ``--input-sentence-size`` lines. The defaults
(identity normalisation, whitespace kept, byte fallback) make decode(encode(text)) == text
for any text, code included. Ids: unk 0, bos 1, eos 2 (the end-of-document token), pad 3.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Iterator, Optional, Sequence

from tqdm import tqdm

from megatron_p2r.cli import run_tool
from megatron_p2r.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="jsonl or text files (optionally .gz)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields of jsonl inputs to train on")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters covered by pieces; the rarest rest become bytes or unk",
    )
    p.add_argument(
        "--byte-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="encode characters outside the vocabulary as UTF-8 byte pieces instead of unk",
    )
    p.add_argument(
        "--normalization-rule-name",
        default="identity",
        choices=["identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"],
    )
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, help="lines sampled for training (0: all)")
    p.add_argument("--max-sentence-length", type=int, default=16384, help="longer lines (bytes) are skipped")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    return p


def is_jsonl(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith((".jsonl", ".json"))


def iter_lines(paths: Sequence[str], json_keys: Sequence[str], skipped: list) -> Iterator[str]:
    """Non-empty lines of every text (jsonl fields split at newlines); bad jsonl lines go to ``skipped``."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not is_jsonl(path):
                    texts = [line]
                elif not line.strip():
                    continue
                else:
                    try:
                        doc = json.loads(line)
                        texts = [doc[key] for key in json_keys]
                    except (ValueError, KeyError, TypeError):
                        skipped.append(f"{path}:{number}")
                        continue
                    if not all(isinstance(t, str) for t in texts):
                        skipped.append(f"{path}:{number}")
                        continue
                for text in texts:
                    for sentence in text.split("\n"):
                        if sentence.strip():
                            yield sentence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 done, 2 bad input (one ``error:`` line), 1 an OS error."""
    args = build_parser().parse_args(argv)
    return run_tool(lambda: train(args))


def train(args) -> int:
    import sentencepiece

    for path in args.input:
        if not os.path.isfile(path):
            raise ConfigError(f"--input {path}: no such file")
    model = args.model_prefix + ".model"
    if os.path.exists(model) and not args.overwrite:
        raise ConfigError(f"{model} already exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(model)), exist_ok=True)
    skipped: list = []
    lines = tqdm(iter_lines(args.input, args.json_keys, skipped), unit=" lines", disable=None, desc="reading")
    try:
        sentencepiece.SentencePieceTrainer.Train(
            sentence_iterator=iter(lines),
            model_prefix=args.model_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            normalization_rule_name=args.normalization_rule_name,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=args.max_sentence_length,
            num_threads=args.num_threads,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise ConfigError(f"SentencePiece training failed: {exc}") from None
    if skipped:
        print(f"skipped {len(skipped)} bad jsonl line(s), first: {', '.join(skipped[:10])}", file=sys.stderr)
    print(f"wrote {model} and {args.model_prefix}.vocab ({args.model_type}, {args.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
