"""Do the memory-lean optimizers cost quality? ``p2r_convergence.py``'s real-from-scratch run (one
model shape, the same data, schedule and fixed held-out set) once per optimizer setting and seed,
each paired with AdamW's run of its seed.

    python benchmarks/lean_optimizers.py [--iters 200] [--seeds 1 2 3] [--model wide] [--work /tmp/lean_study]

Prints every setting's final eval loss per seed and its gap to AdamW's. The settings are the
usual starting points, not tuned here: Lion at a third of AdamW's learning rate and three times
its weight decay (Chen et al. 2023: the same lr x wd), Adafactor at torch's default relative step
cap (lr 1e-2, decayed like AdamW's) with AdamW's weight decay.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.p2r_convergence import ARMS, phase_values, prepare_corpus, train_phase  # noqa: E402

SETTINGS = {  # flags over AdamW's run, as functions of its learning rate and weight decay
    "adam": lambda lr, wd: {},
    "lion": lambda lr, wd: dict(optimizer="lion", lr=lr / 3, min_lr=lr / 30, weight_decay=3 * wd),
    "adafactor": lambda lr, wd: dict(optimizer="adafactor", lr=1e-2, min_lr=1e-3),
}


def final_loss(args, setting: str, seed: int) -> float:
    """The held-out loss at the last step of one run (trained and evaluated unless done before)."""
    phase = ARMS[args.model]["real from scratch"][0]
    values = dict(phase_values(args, args.model, phase, seed), train_iters=args.iters)
    values.update(SETTINGS[setting](values["lr"], values["weight_decay"]))
    points = train_phase(args, values, os.path.join(args.work, "runs", f"{args.model}-{args.iters}-{setting}",
                                                              f"seed{seed}"), None, 0)
    return points[-1][1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--model", default="wide", choices=list(ARMS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--corpus-bytes", type=int, default=6_000_000)
    p.add_argument("--work", default="/tmp/lean_study")
    args = p.parse_args()
    args.eval_interval = min(args.eval_interval, args.iters)
    args.corpus = prepare_corpus(args.work, args.corpus_bytes)
    losses = {s: {seed: final_loss(args, s, seed) for seed in args.seeds} for s in SETTINGS}
    print(f"{args.model} model, {args.iters} steps, final eval loss on the fixed held-out set (gap to AdamW's seed):")
    for setting, by_seed in losses.items():
        cells = [f"seed {seed}: {loss:.4f}" + ("" if setting == "adam" else
                                               f" ({100 * (loss / losses['adam'][seed] - 1):+.2f}%)")
                 for seed, loss in by_seed.items()]
        print(f"  {setting:9s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
