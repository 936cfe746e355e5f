"""MB/s and peak RSS of ``delink`` and ``reshard`` against a plain copy of the same bytes.

    python benchmarks/convert_throughput.py [--hidden 1024] [--layers 4] [--vocab 16000]

Builds a pseudo-phase checkpoint (share pattern ``all``: one slot, ``--layers`` layers) with
AdamW moments -- a few hundred MB -- then, side by side in one run:
- plain copy: every shard copied with ``shutil.copyfile`` and fsync'ed (the converter fsyncs too);
- reshard TP1 PP1 -> TP2 PP2 (reads and writes every byte once);
- delink to the real model, same layout (writes the slot ``--layers`` times);
- delink to the real model at TP2 PP2.
Each conversion runs in its own process: the figures are its conversion time (imports
excluded), MB/s of bytes written, and its peak RSS during the streaming loop above the RSS
the loop started with, next to the size of the largest tensor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import run_streaming  # noqa: E402


def tree_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs if f.endswith(".safetensors")
    )


def make_source(path: str, args) -> None:
    import torch
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.checkpoint.io import save_checkpoint
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state

    cfg = config_from_values(
        dict(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=16,
            seq_length=256,
            vocab_size=args.vocab,
            p2r_phase="pseudo",
            share_pattern="all",
            mock_data=True,
        )
    )
    state = build_train_state(cfg, ParallelState.single())
    for p in state.params:
        p.grad = torch.full_like(p, 1e-3)
    state.optimizer.step()  # the moments exist, as in a real checkpoint
    save_checkpoint(path, state)


def plain_copy(src: str, dst: str) -> float:
    start = time.perf_counter()
    for root, _, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(out, exist_ok=True)
        for f in files:
            shutil.copyfile(os.path.join(root, f), os.path.join(out, f))
            with open(os.path.join(out, f), "rb+") as fh:
                os.fsync(fh.fileno())
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    from megatron_p2r.checkpoint.metadata import metadata_table, read_metadata
    from megatron_p2r.checkpoint.naming import resolve_iteration_dir

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = os.path.join(tmp, "pseudo")
        make_source(src, args)
        src_bytes = tree_bytes(src)
        largest = max(i.nbytes for i in metadata_table(read_metadata(resolve_iteration_dir(src))).values())
        print(
            f"source: pseudo checkpoint, {args.layers} layers sharing one slot, hidden {args.hidden}, "
            f"vocab {args.vocab}: {src_bytes / 1e6:.0f} MB in shards; largest tensor {largest / 1e6:.1f} MB"
        )
        seconds = plain_copy(src, os.path.join(tmp, "copy"))
        rows = [("plain copy (copyfile + fsync)", src_bytes, seconds, None)]
        for name, tp, pp, delink in [
            ("reshard -> TP2 PP2", 2, 2, False),
            ("delink -> real, same layout", 1, 1, True),
            ("delink -> real TP2 PP2", 2, 2, True),
        ]:
            dst = os.path.join(tmp, name.replace(" ", "_").replace(">", ""))
            options = "reshard.DelinkOptions()" if delink else "None"
            r = run_streaming(
                "megatron_p2r.convert.reshard",
                "_write_tensors",
                f"from megatron_p2r.convert import reshard; reshard.convert({src!r}, {dst!r}, "
                f"reshard.Target({tp}, {pp}), {options}, progress=False)",
                ROOT,
            )
            rows.append((name, tree_bytes(dst), r["seconds"], r))
            shutil.rmtree(dst)
        print(f"\n{'':32s} {'MB written':>10s} {'s':>7s} {'MB/s':>7s} {'vs copy':>7s} {'stream +RSS':>11s}")
        copy_rate = rows[0][1] / rows[0][2]
        for name, nbytes, secs, r in rows:
            rate = nbytes / secs
            grow = f"{r['stream'] / 2**20:9.1f}Mi" if r else f"{'-':>11s}"
            print(f"{name:32s} {nbytes / 1e6:10.0f} {secs:7.2f} {rate / 1e6:7.0f} {rate / copy_rate:6.2f}x {grow}")
        base = rows[1][3]["start"]
        print(
            f"\nconverter process RSS before converting (python + torch + package): {base / 2**20:.0f} MiB; "
            f"largest tensor {largest / 2**20:.1f} MiB; checkpoint {src_bytes / 2**20:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
