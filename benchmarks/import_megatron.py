"""MB/s and peak RSS of ``import-megatron`` on a ~300 MB Megatron-LM checkpoint, legacy and
torch_dist, next to a plain copy of the same bytes.

    python benchmarks/import_megatron.py [--layers 8] [--hidden 1024] [--vocab 32000]

Writes a Llama-shaped Megatron checkpoint (bf16, grouped-query attention, SwiGLU, untied
embeddings) saved under TP=2 x PP=2 in both layouts with the test suite's Megatron writers
(tests/convert/megatron/fixtures.py), then, side by side in one run:
- plain copy of the source files (copyfile + fsync);
- import-megatron of each layout into TP=1 and into TP=2 x PP=2 (fp32 output: twice the bytes).
Each import runs in its own process: its time (imports excluded), MB/s of source bytes read
and of bytes written, its peak RSS, and the RSS growth of the streaming loop over the RSS the
loop started with, next to the size of the largest imported tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convert_throughput import plain_copy  # noqa: E402
from measure import run_streaming  # noqa: E402


def tree_bytes(path: str, suffixes) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs if f.endswith(suffixes))


def make_sources(tmp: str, args) -> dict:
    from tests.convert.megatron.fixtures import LLAMA, make_weights, megatron_args, write_legacy, write_torch_dist

    spec = dataclasses.replace(
        LLAMA,
        layers=args.layers,
        hidden=args.hidden,
        heads=16,
        groups=4,
        kv_channels=args.hidden // 16,
        rotary_percent=1.0,
        qk_layernorm=False,
        ffn=args.ffn,
        vocab=args.vocab,
        divisible_by=128,
        seq=4096,
    )
    layout = (2, 2, 1)
    weights = make_weights(spec, layout[0])
    largest = 4 * max(t.numel() for t in weights.values())
    out = {}
    for name, write in (("legacy", write_legacy), ("torch_dist", write_torch_dist)):
        out[name] = os.path.join(tmp, name)
        write(out[name], spec, weights, megatron_args(spec, *layout), layout)
    return out, largest


def run_import(src: str, dst: str, tp: int, pp: int) -> dict:
    return run_streaming(
        "megatron_p2r.convert.imported",
        "write_pieces",
        "from megatron_p2r.convert.megatron.importer import import_megatron; "
        "from megatron_p2r.convert.reshard import Target; "
        f"import_megatron({src!r}, {dst!r}, Target({tp}, {pp}), progress=False)",
        ROOT,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        sources, largest = make_sources(tmp, args)
        rows = []
        for fmt, src in sources.items():
            src_bytes = tree_bytes(src, (".pt", ".distcp", ".metadata"))
            seconds = plain_copy(src, os.path.join(tmp, "copy"))
            shutil.rmtree(os.path.join(tmp, "copy"))
            rows.append((f"{fmt}: plain copy", src_bytes, src_bytes, seconds, None))
            for tp, pp in ((1, 1), (2, 2)):
                dst = os.path.join(tmp, f"{fmt}_tp{tp}_pp{pp}")
                r = run_import(src, dst, tp, pp)
                rows.append((f"{fmt} -> TP{tp} PP{pp}", src_bytes, tree_bytes(dst, ".safetensors"), r["seconds"], r))
                shutil.rmtree(dst)
        print(
            f"source: Megatron-LM Llama-shaped checkpoint, {args.layers} layers, hidden {args.hidden}, ffn "
            f"{args.ffn}, vocab {args.vocab}, bf16, saved under TP2 PP2; largest imported tensor "
            f"{largest / 2**20:.1f} MiB (fp32)"
        )
        print(
            f"\n{'':28s} {'MB read':>8s} {'MB written':>10s} {'s':>6s} {'MB/s read':>9s} {'MB/s written':>12s} "
            f"{'peak RSS':>9s} {'stream +RSS':>11s} {'/ largest':>9s}"
        )
        for name, read, written, secs, r in rows:
            peak = f"{r['peak'] / 2**20:7.0f}Mi" if r else f"{'-':>9s}"
            grow = f"{r['stream'] / 2**20:9.1f}Mi {r['stream'] / largest:8.2f}x" if r else f"{'-':>11s} {'-':>9s}"
            print(
                f"{name:28s} {read / 1e6:8.0f} {written / 1e6:10.0f} {secs:6.2f} {read / 1e6 / secs:9.0f} "
                f"{written / 1e6 / secs:12.0f} {peak} {grow}"
            )
        starts = [r["start"] for *_, r in rows if r]
        print(
            f"\nimporter process RSS before importing (python + torch + package): {min(starts) / 2**20:.0f}-"
            f"{max(starts) / 2**20:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
