"""Does Pseudo-to-Real (or depth growth) pay? Several seeds per arm, paired against real from scratch.

    python benchmarks/p2r_convergence.py [--iters 400] [--seeds 1 2 3] [--models deep wide] [--jobs 2]
                                         [--work /tmp/p2r_study] [--out docs] [--report-only]

Two model shapes (``deep``: 24 layers x hidden 64; ``wide``: 8 x 128), each trained for the
same number of steps by several arms (``ARMS``): real from scratch, Pseudo-to-Real with and
without symmetry breaking, progressive delinking, depth growth. Every arm runs with every
seed; a seed fixes initialisation and data order, so each arm is compared with the scratch run
of its own seed (``p2r_analysis.paired``). Checkpoints are saved every ``--eval-interval`` steps
and evaluated afterwards on one fixed held-out set (the first ``--eval-iters`` batches of the
validation split drawn with seed 1234, the same for every run), plus once right after each
conversion. A separate timing run (``--timing-only`` reruns it) measures each phase's step time
in isolation, interleaving the kinds round by round so that load from other processes on a
shared machine hits all of them alike; wall time to a target is steps x those step times, in two
scenarios: the real model fits, and the real model runs under ``--device-memory-budget`` (the
paper's mechanism: it offloads layers, with recomputation, while the pseudo model fits).

Everything is saved under ``--work`` (records/*.json, timing.json); ``--report-only`` rebuilds
``<out>/results.md`` and ``<out>/p2r_convergence.png`` from them. Runs already recorded are
skipped, so an interrupted study resumes. The demo corpus is built under ``--work`` if missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import p2r_report  # noqa: E402
from benchmarks.p2r_analysis import BUDGET  # noqa: E402

EVAL_SEED = 1234
MODELS = {"deep": dict(layers=24, hidden=64, budget="12MiB"), "wide": dict(layers=8, hidden=128, budget="26MiB")}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One training phase of an arm and the conversion into the next one."""

    until: float                  # fraction of --iters at which it ends
    shallower: int = 1            # the model's layers / this phase's layers (growth)
    pattern: str = "none"         # share pattern; none: the real model
    convert: Tuple[str, ...] = ()  # converter command and options into the next phase


SYMMETRY = ("--noise-std", "0.01", "--noise-relative", "--lr-rewarmup-iters", "{rewarmup}")
ARMS: Dict[str, Dict[str, List[Phase]]] = {
    "deep": {
        "real from scratch": [Phase(1.0)],
        "P2R at 10%": [Phase(0.1, pattern="all", convert=("delink",)), Phase(1.0)],
        "P2R at 10%, noise + re-warm-up": [Phase(0.1, pattern="all", convert=("delink", *SYMMETRY)), Phase(1.0)],
        "progressive all→cycle:4→none": [
            Phase(0.05, pattern="all", convert=("delink", "--target-share-pattern", "cycle:4")),
            Phase(0.15, pattern="cycle:4", convert=("delink", *SYMMETRY)), Phase(1.0)],
        "grow ×4 (stack) at 25%": [Phase(0.25, shallower=4, convert=("grow", "--lr-rewarmup-iters", "{rewarmup}")),
                                   Phase(1.0)],
    },
    "wide": {
        "real from scratch": [Phase(1.0)],
        "P2R at 10%, noise + re-warm-up": [Phase(0.1, pattern="all", convert=("delink", *SYMMETRY)), Phase(1.0)],
        "grow ×2 (stack) at 25%": [Phase(0.25, shallower=2, convert=("grow", "--lr-rewarmup-iters", "{rewarmup}")),
                                   Phase(1.0)],
    },
}


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


def phase_values(args, model: str, phase: Phase, seed: int) -> dict:
    """Config values of one phase (all phases of a run share one LR schedule over --iters)."""
    shape = MODELS[model]
    tok, data = args.corpus
    return dict(num_layers=shape["layers"] // phase.shallower, hidden_size=shape["hidden"], num_attention_heads=4,
                seq_length=args.seq, ffn_hidden_size=4 * shape["hidden"], normalization="RMSNorm", swiglu=True,
                position_embedding_type="rope", tokenizer_type="SentencePieceTokenizer", tokenizer_model=tok,
                data_path=[data], split="98,2,0", micro_batch_size=args.micro_batch, lr=args.lr, min_lr=args.lr / 10,
                lr_warmup_iters=max(args.iters // 25, 1), lr_decay_style="cosine", lr_decay_iters=args.iters,
                weight_decay=0.01, clip_grad=1.0, seed=seed, log_interval=args.eval_interval,
                eval_iters=args.eval_iters, p2r_phase="real" if phase.pattern == "none" else "pseudo",
                share_pattern="all" if phase.pattern == "none" else phase.pattern,
                hidden_dropout=0.0, attention_dropout=0.0, adam_beta2=0.95)


def kind_of(model: str, phase: Phase) -> str:
    return f"{model}/{MODELS[model]['layers'] // phase.shallower}L/{phase.pattern}"


def _key(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:10]


# ----------------------------------------------------------------------------- one run

def evaluate_dirs(values: dict, iter_dirs: List[str]) -> List[float]:
    """Validation loss of each checkpoint on the fixed held-out set (seed EVAL_SEED's batches)."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.checkpoint.io import load_checkpoint
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_datasets, build_train_state, evaluate, resolve_vocab
    cfg = resolve_vocab(config_from_values(dict(values, seed=EVAL_SEED)))
    state = build_train_state(cfg, ParallelState.single())
    _, valid = build_datasets(cfg, state.ps)
    out = []
    for d in iter_dirs:
        load_checkpoint(d, state, finetune=True)
        out.append(evaluate(state, valid))
    return out


def train_phase(args, values: dict, phase_dir: str, load: str, start: int) -> List[list]:
    """Train one phase (unless done before), evaluate its saved checkpoints, keep only the last."""
    done = os.path.join(phase_dir, "evals.json")
    if not os.path.exists(done):
        from megatron_p2r.arguments import config_from_values
        from megatron_p2r.training import pretrain
        shutil.rmtree(phase_dir, ignore_errors=True)
        os.makedirs(phase_dir)
        ckpt = os.path.join(phase_dir, "ckpt")
        pretrain(config_from_values(dict(values, save=ckpt, save_interval=args.eval_interval, load=load,
                                         log_file=os.path.join(phase_dir, "log.jsonl"))))
        dirs = sorted(glob.glob(os.path.join(ckpt, "iter_*")))
        steps = [int(os.path.basename(d)[5:]) for d in dirs]
        losses = evaluate_dirs(values, dirs)
        for d in dirs[:-1]:
            shutil.rmtree(d)
        with open(done, "w") as fh:
            json.dump([[s, v] for s, v in zip(steps, losses, strict=True) if s > start], fh)
    with open(done) as fh:
        return json.load(fh)


def run_arm(args, model: str, arm: str, seed: int) -> dict:
    """Every phase of one arm with one seed; returns its record (phases, evaluation points)."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.metrics import model_flops_per_token
    from tools.convert_checkpoint import main as convert
    phases, points, start, load = [], [], 0, None
    plan = ARMS[model][arm]
    for i, phase in enumerate(plan):
        end = round(phase.until * args.iters)
        values = dict(phase_values(args, model, phase, seed), train_iters=end)
        phase_dir = os.path.join(args.work, "runs", model, f"seed{seed}", _key(plan[:i], phase.until, phase.shallower,
                                                                              phase.pattern, args.iters))
        points += train_phase(args, values, phase_dir, load, start)
        cfg = config_from_values(dict(values, vocab_size=4000, tokenizer_type=None, data_path=None, mock_data=True))
        phases.append({"kind": kind_of(model, phase), "start": start, "end": end,
                       "flops_per_token": model_flops_per_token(cfg.model)})
        if phase.convert:
            nxt = plan[i + 1]
            options = [a.format(rewarmup=max(args.iters // 20, 1)) for a in phase.convert]
            if options[0] == "grow":
                options += ["--num-layers", str(MODELS[model]["layers"] // nxt.shallower)]
            if nxt.pattern != "none":
                options += ["--target-share-pattern", nxt.pattern] if "--target-share-pattern" not in options else []
            load = os.path.join(phase_dir, "to_" + _key(plan[:i + 1], nxt))
            if not os.path.exists(os.path.join(load, "after.json")):
                shutil.rmtree(load, ignore_errors=True)
                convert([options[0], os.path.join(phase_dir, "ckpt"), load, *options[1:], "--no-progress"])
                after = evaluate_dirs(dict(phase_values(args, model, nxt, seed), train_iters=end), [load])[0]
                with open(os.path.join(load, "after.json"), "w") as fh:
                    json.dump(after, fh)
            with open(os.path.join(load, "after.json")) as fh:
                points.append([end, json.load(fh)])
        start = end
    return {"model": model, "arm": arm, "seed": seed, "phases": phases, "points": points,
            "tokens_per_step": args.micro_batch * args.seq}


def record_path(args, model: str, arm: str, seed: int) -> str:
    return os.path.join(args.work, "records", f"{model}_{_key(arm)}_seed{seed}.json")


def worker(args, model: str, seed: int) -> None:
    """All arms of one (model, seed), in order (arms share their common first phases)."""
    for arm in ARMS[model]:
        path = record_path(args, model, arm, seed)
        if not os.path.exists(path):
            record = run_arm(args, model, arm, seed)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as fh:
                json.dump(record, fh)
            os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- timing

def timing_kinds(args) -> Dict[str, Tuple[str, Phase]]:
    return {kind_of(m, p): (m, p) for m in args.models for arm in ARMS[m].values() for p in arm}


def measure_steps(args, values: dict, log: str) -> List[float]:
    """Seconds per step of the steps after --timing-warmup, from the training log."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.training import pretrain
    if os.path.exists(log):
        os.remove(log)
    pretrain(config_from_values(dict(values, train_iters=args.timing_warmup + args.timing_steps, log_interval=1,
                                     log_file=log)))
    with open(log) as fh:
        records = [json.loads(line) for line in fh]
    return [r["ms_per_iter"] / 1000 for r in records if "ms_per_iter" in r and r["iteration"] > args.timing_warmup]


def timing_run(args) -> dict:
    """Every phase kind, with and without the memory budget, round-robin for --timing-rounds."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.layout.plan import ParallelPlan
    samples: Dict[str, List[float]] = {}
    offloaded = {}
    log = os.path.join(args.work, "timing.jsonl")
    for _ in range(args.timing_rounds):
        for kind, (model, phase) in timing_kinds(args).items():
            values = phase_values(args, model, phase, seed=1)
            budget = dict(values, cpu_offload_layers="auto", device_memory_budget=MODELS[model]["budget"])
            for name, v in ((kind, values), (kind + BUDGET, budget)):
                samples.setdefault(name, []).extend(measure_steps(args, v, log))
            cfg = config_from_values(dict(budget, vocab_size=4000, tokenizer_type=None, data_path=None, mock_data=True))
            offloaded[kind] = len(ParallelPlan.model_parallel(cfg).stages[0].offloaded)
    return {"median_s": {k: statistics.median(v) for k, v in samples.items()}, "samples_s": samples,
            "offloaded_layers": offloaded, "budget": {m: MODELS[m]["budget"] for m in args.models},
            "warmup": args.timing_warmup, "steps": args.timing_steps, "rounds": args.timing_rounds}


# ----------------------------------------------------------------------------- driver

def launch_workers(args) -> None:
    """One subprocess per (model, seed), --jobs at a time, each on one thread."""
    pending = [(m, s) for m in args.models for s in args.seeds
               if not all(os.path.exists(record_path(args, m, a, s)) for a in ARMS[m])]
    running = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            model, seed = pending.pop(0)
            out = open(os.path.join(args.work, "logs", f"{model}_seed{seed}.log"), "w")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{model}:{seed}", *args.passthrough]
            running.append((subprocess.Popen(["nice", "-n", "5", *cmd], env=env, stdout=out, stderr=out), model, seed))
        proc, model, seed = running.pop(0)
        if proc.wait() != 0:
            raise SystemExit(f"worker {model}:{seed} failed; see {args.work}/logs/{model}_seed{seed}.log")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2, help="Runs in parallel (one thread each).")
    p.add_argument("--timing-rounds", type=int, default=3)
    p.add_argument("--timing-warmup", type=int, default=3)
    p.add_argument("--timing-steps", type=int, default=8)
    p.add_argument("--timing-only", action="store_true", help="Redo the timing run, then the report.")
    p.add_argument("--report-only", action="store_true", help="Rebuild the report from the saved records.")
    p.add_argument("--note", default="", help="A paragraph to add to the report's verdict.")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--corpus-bytes", type=int, default=6_000_000)
    p.add_argument("--work", default="/tmp/p2r_study")
    p.add_argument("--out", default=os.path.join(ROOT, "docs"))
    return p


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.passthrough = [a for a in argv if a not in ("--report-only", "--timing-only")]
    if "--note" in args.passthrough:
        i = args.passthrough.index("--note")
        del args.passthrough[i:i + 2]
    args.corpus = prepare_corpus(os.path.join(args.work, "corpus"), args.corpus_bytes)
    if args.worker:
        import torch
        torch.set_num_threads(1)
        model, seed = args.worker.split(":")
        worker(args, model, int(seed))
        return
    timing_file = os.path.join(args.work, "timing.json")
    if not args.report_only:
        if not args.timing_only:
            launch_workers(args)
        if args.timing_only or not os.path.exists(timing_file):
            env_threads = os.environ.get("OMP_NUM_THREADS")
            if env_threads != "1":
                raise SystemExit("run the timing with OMP_NUM_THREADS=1 (the training runs use one thread each)")
            with open(timing_file, "w") as fh:
                json.dump(timing_run(args), fh, indent=1)
    records = []
    for path in sorted(glob.glob(os.path.join(args.work, "records", "*.json"))):
        with open(path) as fh:
            records.append(json.load(fh))
    with open(timing_file) as fh:
        timing = json.load(fh)
    p2r_report.write(records, timing, args, ARMS, MODELS, args.out)


if __name__ == "__main__":
    main()
