"""Does Pseudo-to-Real pay off? Validation loss for one model shape and one token budget:

  (a) real from scratch;
  (b) Pseudo-to-Real, delinking after 10%, 25% and 50% of the budget (optimizer state copied),
      and at 25% with the optimizer state copied, rescaled or reset;
  (c) pseudo only (share-pattern all for the whole budget).

    python benchmarks/p2r_convergence.py [--iters 200] [--layers 6] [--hidden 128] [--out docs]

Runs in-process on one CPU rank on the demo corpus (built under --work if missing). Writes
``<out>/results.md`` (table: final validation loss; loss at 50% and at the end against tokens,
training FLOPs and wall time) and ``<out>/p2r_convergence.png``. The defaults take well under
an hour on 2 cores; the flags scale it up. Numbers are reported as measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.metrics import model_flops_per_token  # noqa: E402
from megatron_p2r.training import pretrain  # noqa: E402


def prepare_corpus(work: str, max_bytes: int) -> tuple:
    os.makedirs(work, exist_ok=True)
    corpus, tok, prefix = f"{work}/corpus.jsonl", f"{work}/tokenizer", f"{work}/corpus"
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # noqa: E731
    if not os.path.exists(corpus):
        run("tools/build_demo_corpus.py", "--output", corpus, "--max-bytes", str(max_bytes))
    if not os.path.exists(tok + ".model"):
        run("tools/train_tokenizer.py", "--input", corpus, "--model-prefix", tok, "--vocab-size", "4000",
            "--model-type", "bpe", "--input-sentence-size", "200000")
    if not os.path.exists(prefix + "_text_document.idx"):
        run("tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", tok + ".model", "--append-eod")
    return tok + ".model", prefix + "_text_document"


def base_values(args, tok: str, data: str) -> dict:
    return dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, seq_length=args.seq,
                ffn_hidden_size=4 * args.hidden, normalization="RMSNorm", swiglu=True,
                position_embedding_type="rope", tokenizer_type="SentencePieceTokenizer", tokenizer_model=tok,
                data_path=[data], split="98,2,0", micro_batch_size=args.micro_batch, lr=args.lr,
                min_lr=args.lr / 10, lr_warmup_iters=max(args.iters // 30, 1), lr_decay_style="cosine",
                lr_decay_iters=args.iters, train_iters=args.iters, weight_decay=0.01, clip_grad=1.0,
                seed=args.seed, log_interval=args.eval_interval, eval_interval=args.eval_interval,
                eval_iters=args.eval_iters, hidden_dropout=0.0, attention_dropout=0.0, adam_beta2=0.95)


def run_phase(values: dict, log: str) -> None:
    """Train one phase in-process, logging to ``log``."""
    pretrain(config_from_values(dict(values, log_file=log)))


def eval_curve(logs) -> list:
    """[(tokens, eval_loss, wall seconds)] over a run's phases in order; wall time is the sum of
    the logged per-iteration times (evaluation and start-up excluded)."""
    points, wall, last_iter = [], 0.0, 0
    for log in logs:
        for r in (json.loads(line) for line in open(log)):
            if "ms_per_iter" in r:
                wall += r["ms_per_iter"] / 1000 * (r["iteration"] - last_iter)
                last_iter = r["iteration"]
            elif "eval_loss" in r:
                points.append((r["tokens"], r["eval_loss"], wall))
    return points


def plan_runs(args) -> dict:
    """run name -> its phases as (config overrides, log path, checkpoint to delink or None)."""
    runs = {"real from scratch": [({}, "real/log.jsonl", None)],
            "pseudo only": [(dict(p2r_phase="pseudo", share_pattern="all"), "pseudo/log.jsonl", None)]}
    for frac in args.switch:
        switch, d = max(int(args.iters * frac), 1), f"switch{int(frac * 100)}"
        pseudo = (dict(p2r_phase="pseudo", share_pattern="all", train_iters=switch, save=f"{d}/pseudo"),
                  f"{d}/pseudo.jsonl", None)
        states = args.optimizer_states if frac == args.compare_states_at else args.optimizer_states[:1]
        for state in states:
            real = (dict(load=f"{d}/real_{state}"), f"{d}/real_{state}.jsonl", (f"{d}/pseudo", state))
            runs[f"P2R at {int(frac * 100)}%, {state}"] = [pseudo, real]
    return runs


def run_all(args) -> dict:
    tok, data = prepare_corpus(args.work, args.corpus_bytes)
    base = base_values(args, tok, data)
    root = f"{args.work}/runs"
    runs = plan_runs(args)
    if not args.report_only:
        from tools.convert_checkpoint import main as convert
        shutil.rmtree(root, ignore_errors=True)
        done = set()
        for phases in runs.values():
            for overrides, log, delink in phases:
                if log in done:  # a pseudo phase shared by several optimizer-state variants
                    continue
                os.makedirs(os.path.dirname(f"{root}/{log}"), exist_ok=True)
                values = {k: f"{root}/{v}" if k in ("save", "load") else v for k, v in overrides.items()}
                if delink:
                    convert(["delink", f"{root}/{delink[0]}", f"{root}/{overrides['load']}",
                             "--optimizer-state", delink[1], "--no-progress"])
                run_phase(dict(base, **values), f"{root}/{log}")
                done.add(log)
    return {name: eval_curve([f"{root}/{log}" for _, log, _ in phases]) for name, phases in runs.items()}


def write_report(runs: dict, args, out: str) -> None:
    cfg = config_from_values(dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                                  seq_length=args.seq, ffn_hidden_size=4 * args.hidden, swiglu=True,
                                  vocab_size=4000, mock_data=True))
    flops_per_token = model_flops_per_token(cfg.model)
    total_tokens = args.iters * args.micro_batch * args.seq
    lines = [
        "# Pseudo-to-Real convergence at small scale",
        "",
        f"Measured by `python benchmarks/p2r_convergence.py --iters {args.iters} --layers {args.layers} "
        f"--hidden {args.hidden}` on this project's 2-core CPU machine: {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, SwiGLU/RMSNorm/rotary, "
        f"SentencePiece vocab 4000 on the demo corpus (Python stdlib source); {args.iters} steps = "
        f"{total_tokens:,} tokens = {total_tokens * flops_per_token:.3g} training FLOPs per run "
        "(pseudo and real cost the same FLOPs per token: sharing saves memory, not compute). "
        f"Validation loss on a fixed set of {args.eval_iters} batches.",
        "",
        "| run | eval loss at 50% of tokens | final eval loss | wall time (s) |",
        "|---|---|---|---|",
    ]
    for name, pts in runs.items():
        half = min(pts, key=lambda p: abs(p[0] - total_tokens / 2))
        lines.append(f"| {name} | {half[1]:.4f} | {pts[-1][1]:.4f} | {pts[-1][2]:.0f} |")
    best = min(runs, key=lambda k: runs[k][-1][1])
    lines += ["", f"Lowest final validation loss: **{best}**.", ""]
    if args.note:
        lines += [args.note, ""]
    lines += [
              "![validation loss](p2r_convergence.png)", ""]
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/results.md", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, pts in runs.items():
        tokens, loss, wall = zip(*pts)
        axes[0].plot(tokens, loss, label=name)
        axes[1].plot([t * flops_per_token for t in tokens], loss, label=name)
        axes[2].plot(wall, loss, label=name)
    for ax, xlabel in zip(axes, ["tokens", "training FLOPs", "wall time (s)"]):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/p2r_convergence.png", dpi=90)
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--switch", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--optimizer-states", nargs="+", default=["copy", "rescale", "reset"],
                   choices=["copy", "rescale", "reset"],
                   help="compared at --compare-states-at; other switch points use the first one")
    p.add_argument("--compare-states-at", type=float, default=0.25)
    p.add_argument("--report-only", action="store_true", help="rebuild the report from the logs of a previous run")
    p.add_argument("--note", default="", help="a paragraph to add to the report (how it was measured)")
    p.add_argument("--corpus-bytes", type=int, default=6_000_000)
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "p2r_convergence"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs"))
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    write_report(run_all(args), args, args.out)


if __name__ == "__main__":
    main()
