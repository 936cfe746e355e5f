"""Tokens/s of tools/preprocess_data.py (1 and 2 workers) against Hugging Face ``tokenizers``.

    python benchmarks/preprocess_throughput.py [--max-bytes 4000000] [--vocab-size 8000]

Builds the demo corpus (Python stdlib sources), trains a byte-level BPE on it with Hugging
Face ``tokenizers`` and then, with the same vocab.json/merges.txt, times:
- preprocess_data.py with GPT2BPETokenizer, 1 and 2 workers: read jsonl, parse, tokenise,
  write .bin/.idx (end to end);
- ``ByteLevelBPETokenizer.encode_batch`` on the texts already in memory (Rust, all cores).
Both must produce the same token count, which the script checks. Needs ``tokenizers``
(``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import build_demo_corpus, preprocess_data  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="size of the demo corpus slice")
    p.add_argument("--vocab-size", type=int, default=8000)
    args = p.parse_args(argv)
    from tokenizers import ByteLevelBPETokenizer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        build_demo_corpus.main(["--output", corpus, "--max-bytes", str(args.max_bytes)])
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(
            texts, vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"], show_progress=False
        )
        trainer.save_model(tmp)
        vocab, merges = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")

        rows = []
        for workers in (1, 2):
            ns = preprocess_data.build_parser().parse_args(
                [
                    "--input",
                    corpus,
                    "--output-prefix",
                    os.path.join(tmp, f"w{workers}"),
                    "--tokenizer-type",
                    "GPT2BPETokenizer",
                    "--vocab-file",
                    vocab,
                    "--merge-file",
                    merges,
                    "--workers",
                    str(workers),
                ]
            )
            stats = preprocess_data.preprocess(ns)
            rows.append((f"preprocess_data.py, {workers} worker(s), end to end", stats.tokens, stats.seconds))

        hf = ByteLevelBPETokenizer(vocab, merges)
        start = time.perf_counter()
        encodings = hf.encode_batch(texts)
        seconds = time.perf_counter() - start
        rows.append(
            ("HF tokenizers encode_batch (Rust, threads), in memory", sum(len(e.ids) for e in encodings), seconds)
        )

    print(
        f"corpus: {len(texts)} stdlib files, {sum(len(t.encode()) for t in texts):,} bytes; "
        f"BPE vocab {args.vocab_size}; {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f}"
    )
    for name, tokens, seconds in rows:
        print(f"{name:<56} {tokens:>10,} tokens {seconds:7.2f} s {tokens / seconds:>12,.0f} tokens/s")
    if len({tokens for _, tokens, _ in rows}) != 1:
        raise SystemExit("token counts differ between the runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
