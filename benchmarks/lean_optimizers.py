"""Do the memory-lean optimizers cost quality? The convergence study's (``p2r-study``) real-from-scratch
run (one model shape, the same data, schedule and fixed held-out set) once per optimizer setting and seed,
each paired with AdamW's run of its seed.

    python benchmarks/lean_optimizers.py [--iters 200] [--seeds 1 2 3] [--model wide=8x128] [--settings ...]
        [--data-path PREFIX|CORPUS.jsonl ...] [--work /tmp/lean_study]

The corpus, held-out set and training options are the study's (``p2r-study --help``); the held-out
set defaults here to the corpus's last documents (``--held-out tail``), as when the figures in
docs/scale.md were measured.
Prints every setting's final held-out loss per seed with its standard error, and its gap to
AdamW's run of the same seed with the paired standard error (the same held-out samples). The
settings are the usual starting points, not tuned here: Lion at a third of AdamW's learning rate
and three times its weight decay (Chen et al. 2023: the same lr x wd), Adafactor at torch's
default relative step cap (lr 1e-2, decayed like AdamW's) with AdamW's weight decay. The
precision-aware settings are AdamW's run with one dtype lowered (``--use-precision-aware-optimizer``):
both moments in bf16, the main gradients in bf16, and fp16 main parameters — which need 16-bit
weights, so that one runs with ``--bf16`` weights, beside AdamW with ``--bf16`` weights and fp32
mains (``adam-bf16``) to tell the two costs apart; and V100's precision: ``--fp16`` weights with
dynamic loss scaling and fp32 mains (``adam-fp16``), and the same weights as their own fp16 mains
(``adam-fp16-fp16-main-params``: 2 B of weight, no higher-precision copy). ``adam-bf16-offload-half`` offloads half the
layers with the overlapped host step (the same math as ``adam-bf16``); ``...-dpu`` adds the
one-step delayed parameter update (after its 40 undelayed warm-up steps), its gap taken against
``adam-bf16-offload-half``'s seed. ``--settings`` runs a subset. Runs are saved under ``--work``
and not trained again when rerun.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.p2r_study import arms as p2r_arms, corpus as p2r_corpus  # noqa: E402
from tools.p2r_study.cli import add_corpus_options, add_training_options  # noqa: E402
from tools.p2r_study.heldout import HeldOutTooSmall, mean_se, paired_se  # noqa: E402
from tools.p2r_study.runs import phase_values, train_phase  # noqa: E402

SETTINGS = {  # flags over AdamW's run, as functions of its learning rate and weight decay
    "adam": lambda lr, wd: {},
    "lion": lambda lr, wd: dict(optimizer="lion", lr=lr / 3, min_lr=lr / 30, weight_decay=3 * wd),
    "adafactor": lambda lr, wd: dict(optimizer="adafactor", lr=1e-2, min_lr=1e-3),
    "adam-bf16-moments": lambda lr, wd: dict(
        use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"
    ),
    "adam-bf16-main-grads": lambda lr, wd: dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16"),
    "adam-bf16": lambda lr, wd: dict(bf16=True),
    "adam-bf16-fp16-main-params": lambda lr, wd: dict(
        bf16=True, use_precision_aware_optimizer=True, main_params_dtype="fp16"
    ),
    "adam-fp16": lambda lr, wd: dict(fp16=True),
    "adam-fp16-fp16-main-params": lambda lr, wd: dict(
        fp16=True, use_precision_aware_optimizer=True, main_params_dtype="fp16"
    ),
    "adam-bf16-offload-half": lambda lr, wd: dict(
        bf16=True, cpu_offload_layers="0.5", overlap_cpu_optimizer_d2h_h2d=True
    ),
    "adam-bf16-offload-half-dpu": lambda lr, wd: dict(
        bf16=True, cpu_offload_layers="0.5", overlap_cpu_optimizer_d2h_h2d=True, cpu_offload_delayed_param_update=True
    ),
}
# the run each setting's gap is taken against, seed by seed (AdamW's unless named here)
PAIRED_WITH = {"adam-bf16-offload-half-dpu": "adam-bf16-offload-half"}


def final_losses(args, setting: str, seed: int) -> list:
    """Per-sample held-out losses at the last step of one run (trained unless done before)."""
    values = dict(phase_values(args, args.model_name, p2r_arms.Phase(1.0), seed), train_iters=args.iters)
    values.update(SETTINGS[setting](values["lr"], values["weight_decay"]))
    run_dir = os.path.join(args.work, "runs", f"{args.model_name}-{args.iters}-{setting}", f"seed{seed}")
    return train_phase(args, values, run_dir, None, 0)["last"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_corpus_options(p)
    add_training_options(p)
    p.add_argument("--model", default="wide=8x128", metavar="NAME=LAYERSxHIDDEN", help="the model shape")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--work", default="/tmp/lean_study")
    p.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="the settings to run (with the runs they pair with)",
    )
    p.set_defaults(iters=200, eval_interval=50, held_out="tail")
    args = p.parse_args(argv)
    try:
        args.model_name, shape = p2r_arms.parse_shape(args.model)
        args.shapes = {args.model_name: shape}
        args.eval_interval = min(args.eval_interval, args.iters)
        args.corpus = p2r_corpus.prepare(args, os.path.join(args.work, "corpus"))
        wanted = {"adam"} | set(args.settings) | {PAIRED_WITH[s] for s in args.settings if s in PAIRED_WITH}
        losses = {s: {seed: final_losses(args, s, seed) for seed in args.seeds} for s in SETTINGS if s in wanted}
    except (p2r_arms.ArmError, p2r_corpus.CorpusError, HeldOutTooSmall) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.model_name} model ({shape.layers} x {shape.hidden}), {args.iters} steps, {args.corpus.name}: "
        f"final loss on {args.eval_samples} held-out samples ± its standard error (gap to AdamW's seed ± paired SE):"
    )
    for setting, by_seed in losses.items():
        cells = []
        for seed, values in by_seed.items():
            mean, se = mean_se(values)
            cell = f"seed {seed}: {mean:.4f} ± {se:.4f}"
            if setting != "adam":
                baseline = PAIRED_WITH.get(setting, "adam")
                paired = losses[baseline][seed]
                base = mean_se(paired)[0]
                cell += f" ({100 * (mean / base - 1):+.2f}% ± {100 * paired_se(values, paired) / base:.2f}" + (
                    f" to {baseline})" if baseline != "adam" else ")"
                )
            cells.append(cell)
        print(f"  {setting:26s} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
