"""What the per-tensor CRC-32 checksums cost a checkpoint save and load, as a ratio.

    python benchmarks/checksum_cost.py [--hidden 512] [--layers 4] [--vocab 16000] [--repeats 5]

Builds a model with AdamW moments (a few hundred MB of shards), then alternates, in one process:
- save_checkpoint as shipped (a CRC-32 of every tensor as it is written) and with the checksum
  replaced by a constant (the cost of the save without it);
- load_checkpoint of a checkpoint whose metadata.json records the checksums (every tensor read
  is checked) and of the same checkpoint without them (an older checkpoint: nothing checked).
The fastest of ``--repeats`` runs each (in alternating order; the least disturbed by other jobs
on a shared machine), after one warm-up round, in wall time and in this process's
CPU time (which other jobs on a shared machine do not inflate; the checksum is pure CPU, so the
CPU ratio bounds the wall ratio from above). The shards are in the page cache when loaded: a load
from disk spends longer reading and the same on the checksums.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_state(args):
    import torch
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state

    cfg = config_from_values(
        dict(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=8,
            seq_length=256,
            vocab_size=args.vocab,
            mock_data=True,
        )
    )
    state = build_train_state(cfg, ParallelState.single())
    for p in state.params:
        p.grad = torch.full_like(p, 1e-3)
    state.optimizer.step()  # the moments exist, as in a real checkpoint
    return cfg, state


def timed(fn) -> tuple:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    from megatron_p2r.checkpoint import safetensors_io
    from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state

    cfg, state = build_state(args)
    fresh = build_train_state(cfg, ParallelState.single())
    saves = {"with": [], "without": []}
    loads = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        checked, unchecked = os.path.join(tmp, "checked"), os.path.join(tmp, "unchecked")
        for round_ in range(args.repeats + 1):
            for mode in ("with", "without")[:: 1 if round_ % 2 else -1]:  # ABBA: order effects cancel
                shutil.rmtree(checked, ignore_errors=True)
                safetensors_io.zlib = zlib if mode == "with" else _NoChecksum
                seconds = timed(lambda: save_checkpoint(checked, state))
                if round_:  # round 0 warms up
                    saves[mode].append(seconds)
        safetensors_io.zlib = zlib
        save_checkpoint(checked, state)
        shutil.copytree(checked, unchecked)
        meta_path = os.path.join(unchecked, "iter_0000000", "metadata.json")
        with open(meta_path) as fh:
            meta = json.load(fh)
        del meta["crc32"]
        with open(meta_path, "w") as fh:
            json.dump(meta, fh)
        size = sum(meta["files"].values())
        for round_ in range(args.repeats + 1):
            for mode, path in (("with", checked), ("without", unchecked))[:: 1 if round_ % 2 else -1]:
                seconds = timed(lambda: load_checkpoint(path, fresh))
                if round_:
                    loads[mode].append(seconds)
    data = os.urandom(64 * 2**20)
    crc_rate = 64 * 2**20 / min(timed(lambda: zlib.crc32(data))[0] for _ in range(5))
    print(
        f"checkpoint: {size / 1e6:.0f} MB of shards (hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, weights + AdamW moments); zlib.crc32 alone: {crc_rate / 1e9:.2f} GB/s"
    )
    for what, runs in (("save", saves), ("load", loads)):
        for i, clock in enumerate(("wall", "CPU")):
            w, wo = (min(r[i] for r in runs[mode]) for mode in ("with", "without"))
            print(f"{what} ({clock}): {w:.3f} s with checksums, {wo:.3f} s without: ratio {w / wo:.2f}")
    return 0


class _NoChecksum:
    """Stands in for zlib in the shard writer: the save without checksums."""

    @staticmethod
    def crc32(data) -> int:
        return 0


if __name__ == "__main__":
    sys.exit(main())
