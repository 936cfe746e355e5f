"""p2r-study: does Pseudo-to-Real (or depth growth) pay on your data? Several seeds per arm, paired against scratch.

    p2r-study --work DIR [--out DIR] [--name p2r_study]
        [--data-path PREFIX|CORPUS.jsonl --tokenizer-type T --tokenizer-model M]
        [--valid-data-path PREFIX|CORPUS.jsonl | --valid-fraction 0.05 [--held-out documents|tail]]
        [--eval-samples 256] [--iters 400] [--seeds 1 2 3] [--model NAME=LAYERSxHIDDEN[@BUDGET] ...]
        [--models deep wide] [--arms p2r p2r-noise progressive grow matched] [--p2r-at 0.1]
        [--grow-at 0.1 0.25 0.5] [--grow-factors 2 4] [--jobs 2] [--report-only]

(also ``python -m tools.p2r_study``). Without ``--data-path`` the study runs on a demo corpus built
under ``--work`` (the Python standard library's source, or with ``--demo-source docs`` its English
documentation), with a 4000-piece SentencePiece BPE trained on it; a jsonl is tokenised with
``tools/preprocess_data.py`` (and, without ``--tokenizer-type``, that BPE). Model shapes default to
``deep`` (24 layers x hidden 64) and ``wide`` (8 x 128), each trained for the same number of steps
by several arms (``arms``): real from scratch, Pseudo-to-Real with and without symmetry
breaking, progressive delinking, depth growth by stacking, and for every growth arm a
compute-matched control (scratch decayed at the growth arm's FLOPs). A seed fixes initialisation
and data order, so each arm is compared with the scratch run of its own seed
(``analysis.paired``). Checkpoints are saved every ``--eval-interval`` steps and evaluated on one
fixed held-out set of ``--eval-samples`` samples (plus once right after each conversion). A
separate timing run (``--timing-rounds 0`` skips it, ``--timing-only`` redoes it) measures each
phase's step time, interleaving the kinds; wall time to a target is steps x those step times.

Relative paths are the caller's. The study writes only under ``--work`` (the corpus, each
finished phase, conversion and run, written atomically and skipped when rerun, so a killed study
continues where it stopped) and ``--out`` (default ``WORK/report``): ``<out>/<name>.md`` and
``<out>/<name>.png``, rebuilt from the records alone by ``--report-only``. ``WORK/study.json``
records the data given and its SHA-256: a ``--work`` built from other data or settings is
refused, and so is a report that would replace one this ``--work`` did not write.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

from megatron_p2r.cli import INPUT_ERRORS
from tools.p2r_study import arms as p2r_arms, corpus as p2r_corpus, identity, report as p2r_report
from tools.p2r_study.heldout import HeldOutTooSmall, cache_dir, held_out_set, sample_documents
from tools.p2r_study.runs import model_values, phase_values, read_json, record_path, worker, write_json

# the project's own input errors too (a tokenizer's options, a config the model refuses)
STUDY_ERRORS = (p2r_arms.ArmError, p2r_corpus.CorpusError, HeldOutTooSmall, identity.IdentityError, *INPUT_ERRORS)


class StudyError(ValueError):
    """Options that cannot make a study: reported as one ``error:`` line."""


def add_corpus_options(p: argparse.ArgumentParser) -> None:
    """The corpus and its held-out set (shared with benchmarks/lean_optimizers.py)."""
    data = p.add_argument_group("corpus")
    data.add_argument(
        "--data-path", help="Megatron .bin/.idx prefix, or a .jsonl(.gz) to preprocess (default: the demo corpus)"
    )
    data.add_argument(
        "--tokenizer-type",
        help="as pretrain_m6.py's (default for a jsonl: a 4000-piece SentencePiece BPE trained on it)",
    )
    data.add_argument("--tokenizer-model", help="as pretrain_m6.py's")
    data.add_argument(
        "--valid-data-path", help="held-out prefix or jsonl (default: --valid-fraction of --data-path's documents)"
    )
    data.add_argument(
        "--valid-fraction",
        type=float,
        default=0.05,
        help="documents held out from --data-path when there is no --valid-data-path",
    )
    data.add_argument(
        "--held-out",
        choices=p2r_corpus.HELD_OUT_MODES,
        default="documents",
        help="which documents: a seeded random sample (the rest is trained on, both copied under "
        "--work), or the last ones (Megatron-LM's --split rule; risky for a sorted corpus)",
    )
    data.add_argument("--held-out-seed", type=int, default=1234, help="the seed of --held-out documents")
    data.add_argument(
        "--eval-samples",
        type=int,
        default=256,
        help="held-out samples every checkpoint is evaluated on (sets the standard error)",
    )
    data.add_argument("--corpus-bytes", type=int, default=6_000_000, help="size of the demo corpus")
    data.add_argument(
        "--demo-source",
        choices=sorted(p2r_corpus.DEMO_NAMES),
        default="code",
        help="the demo corpus without --data-path: the stdlib's code, or its documentation in English "
        "(tools/build_demo_corpus.py --source)",
    )


def add_training_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The schedule every run trains with (shared with benchmarks/lean_optimizers.py)."""
    train = p.add_argument_group("training")
    train.add_argument("--iters", type=int, default=400)
    train.add_argument("--seq", type=int, default=128)
    train.add_argument("--micro-batch", type=int, default=8)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--eval-interval", type=int, default=25)
    return train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="p2r-study", description=__doc__.splitlines()[0], allow_abbrev=False)
    add_corpus_options(p)
    arms = p.add_argument_group("arms")
    arms.add_argument(
        "--model",
        action="append",
        metavar="NAME=LAYERSxHIDDEN[@BUDGET]",
        help=f"a model shape, repeatable (default {' '.join(p2r_arms.DEFAULT_SHAPES)}); @BUDGET "
        "adds the memory-budget scenario to the timing run",
    )
    arms.add_argument("--models", nargs="+", help="which of the shapes to run (default all)")
    arms.add_argument(
        "--arms",
        nargs="+",
        choices=p2r_arms.ARM_KINDS,
        dest="arm_kinds",
        help="arm kinds besides real from scratch (default: deep all, other shapes p2r-noise grow matched)",
    )
    arms.add_argument("--p2r-at", type=float, nargs="+", default=[0.1], help="delink points, fractions of --iters")
    arms.add_argument("--grow-at", type=float, nargs="+", default=[0.25], help="growth points, fractions of --iters")
    arms.add_argument(
        "--grow-factors", type=int, nargs="+", help="growth depth factors (default: deep 4, other shapes 2)"
    )
    arms.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    train = add_training_options(p)
    train.add_argument("--jobs", type=int, default=2, help="Runs in parallel (one thread each).")
    timing = p.add_argument_group("timing and report")
    timing.add_argument("--timing-rounds", type=int, default=3, help="0: no timing run, no wall-time figures")
    timing.add_argument("--timing-warmup", type=int, default=3)
    timing.add_argument("--timing-steps", type=int, default=8)
    timing.add_argument("--timing-only", action="store_true", help="Redo the timing run, then the report.")
    timing.add_argument("--report-only", action="store_true", help="Rebuild the report from the saved records.")
    timing.add_argument("--note", default="", help="A paragraph to add to the report's verdict.")
    timing.add_argument("--work", required=True, help="the study's directory: corpus, runs, records (created)")
    timing.add_argument("--out", help="directory of the report (default: WORK/report)")
    timing.add_argument("--name", default="p2r_study", help="the report's file name: <out>/<name>.md and .png")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def resolve_shapes(args) -> None:
    """args.shapes and args.models from the options, and the counts checked (before any data is
    prepared, so a typo fails at once)."""
    args.shapes = dict(p2r_arms.parse_shape(text) for text in (args.model or p2r_arms.DEFAULT_SHAPES))
    args.models = args.models or list(args.shapes)
    unknown = [m for m in args.models if m not in args.shapes]
    if unknown:
        raise StudyError(f"--models {' '.join(unknown)}: no such shape; the shapes are {', '.join(args.shapes)}")
    for name, value in (
        ("--iters", args.iters),
        ("--eval-interval", args.eval_interval),
        ("--seq", args.seq),
        ("--micro-batch", args.micro_batch),
        ("--eval-samples", args.eval_samples),
        ("--jobs", args.jobs),
    ):
        if value < 1:
            raise StudyError(f"{name} must be at least 1, got {value}")


def resolve_arms(args) -> None:
    """args.arms, {model: {arm: phases}}, from the options (a control's length needs the
    corpus's vocabulary: it matches FLOPs)."""
    shapes = args.shapes
    args.arms = {}
    for model in args.models:
        kinds = args.arm_kinds or p2r_arms.DEFAULT_ARMS.get(model, p2r_arms.DEFAULT_ARMS["wide"])
        factors = args.grow_factors or p2r_arms.DEFAULT_GROW_FACTORS.get(model, (2,))
        args.arms[model] = p2r_arms.build_arms(
            shapes[model],
            kinds,
            args.p2r_at,
            args.grow_at,
            factors,
            lambda layers, m=model: _flops_per_token(args, m, layers),
        )


def _flops_per_token(args, model: str, layers: int) -> float:
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.metrics import model_flops_per_token

    values = dict(phase_values(args, model, p2r_arms.Phase(1.0), seed=1), num_layers=layers)
    return model_flops_per_token(config_from_values(model_values(values, args.vocab_size)).model)


def _vocab_size(corpus) -> int:
    from megatron_p2r.config import DataConfig
    from megatron_p2r.data.tokenizers import build_tokenizer

    data = DataConfig(tokenizer_type=corpus.tokenizer_type, tokenizer_model=corpus.tokenizer_model)
    return build_tokenizer(data).vocab_size


PATH_ATTRS = ("work", "out", "data_path", "valid_data_path", "tokenizer_model")


def resolve_paths(args) -> None:
    """Every path option absolute against the caller's directory (a --tokenizer-model that is no
    file, a Hugging Face name, is left as given); --out defaults under --work; a --work or --out
    that names a file is refused."""
    args.out = args.out or os.path.join(args.work, "report")
    for attr in PATH_ATTRS:
        value = getattr(args, attr)
        if value and (attr != "tokenizer_model" or os.path.exists(value)):
            setattr(args, attr, os.path.abspath(os.path.expanduser(value)))
    for flag, path in (("--work", args.work), ("--out", args.out)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise StudyError(f"{flag} {path} is a file; expected a directory (created when missing)")


def check_report_target(args) -> None:
    """Refuse to replace a report this --work did not write (a shipped one in docs/, another study's)."""
    for suffix in (".md", ".png"):
        path = os.path.join(args.out, args.name + suffix)
        if not os.path.exists(path):
            continue
        page = os.path.join(args.out, args.name + ".md")
        ours = (
            os.path.exists(page)
            and p2r_report.MARKER.format(key=args.study_key) in open(page, encoding="utf-8", errors="replace").read()
        )
        if not ours:
            raise StudyError(
                f"{path} exists and was not written by the study in --work {args.work}: give another "
                "--out or --name (or remove it)"
            )


def launch_workers(args) -> None:
    """One subprocess per (model, seed), --jobs at a time, each on one thread; a line per finished run."""
    todo = [(m, a, s) for m in args.models for s in args.seeds for a in args.arms[m]]
    done = lambda: [t for t in todo if os.path.exists(record_path(args, *t))]  # noqa: E731
    pending = [
        (m, s)
        for m in args.models
        for s in args.seeds
        if not all(os.path.exists(record_path(args, m, a, s)) for a in args.arms[m])
    ]
    reported, started = set(done()), time.monotonic()
    print(
        f"{len(todo)} runs ({len(args.models)} models x arms x {len(args.seeds)} seeds), {len(reported)} done "
        f"before; logs in {args.work}/logs",
        flush=True,
    )
    running = []
    env = dict(p2r_corpus.tool_env(), OMP_NUM_THREADS="1")
    os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            model, seed = pending.pop(0)
            out = open(os.path.join(args.work, "logs", f"{model}_seed{seed}.log"), "a")
            cmd = [sys.executable, "-m", "tools.p2r_study", "--worker", f"{model}:{seed}", *args.passthrough]
            running.append((subprocess.Popen(["nice", "-n", "5", *cmd], env=env, stdout=out, stderr=out), model, seed))
        time.sleep(1)
        for model, arm, seed in [t for t in done() if t not in reported]:
            reported.add((model, arm, seed))
            print(
                f"[{len(reported)}/{len(todo)}] {model} seed {seed}: {arm} "
                f"({(time.monotonic() - started) / 60:.1f} min)",
                flush=True,
            )
        for entry in [r for r in running if r[0].poll() is not None]:
            running.remove(entry)
            proc, model, seed = entry
            if proc.returncode != 0:
                raise StudyError(f"the runs of {model} seed {seed} failed; see {args.work}/logs/{model}_seed{seed}.log")


def load_records(args) -> list:
    """The saved runs of the configured models, arms and seeds whose seed's scratch run is saved too
    (every comparison is paired with it)."""
    wanted = {record_path(args, m, a, s) for m in args.models for a in args.arms[m] for s in args.seeds}
    records = [read_json(p) for p in sorted(glob.glob(os.path.join(args.work, "records", "*.json"))) if p in wanted]
    scratch = {(r["model"], r["seed"]) for r in records if r["arm"] == p2r_arms.SCRATCH}
    records = [r for r in records if (r["model"], r["seed"]) in scratch]
    if not records:
        raise StudyError(
            f"no finished run in --work {args.work} for these models, arms and seeds (real from scratch "
            "with at least one seed is needed): run the study without --report-only first"
        )
    return records


def run_study(args, argv) -> None:
    args.passthrough = [a for a in argv if a not in ("--report-only", "--timing-only")]
    if "--note" in args.passthrough:
        i = args.passthrough.index("--note")
        del args.passthrough[i : i + 2]
    resolve_shapes(args)
    resolve_paths(args)
    if args.worker:  # started by the study, which checked the data and wrote study.json
        args.study_key = identity.identity_key(read_json(os.path.join(args.work, "study.json")))
    else:
        study = identity.study_identity(args)
        os.makedirs(args.work, exist_ok=True)
        identity.check(args.work, study, write_json, read_json)
        args.study_key = identity.identity_key(study)
        check_report_target(args)
        if args.report_only and not glob.glob(os.path.join(args.work, "records", "*.json")):
            raise StudyError(
                f"--report-only: no finished run in --work {args.work} yet; run the study without --report-only first"
            )
    args.corpus = p2r_corpus.prepare(args, os.path.join(args.work, "corpus"))
    args.vocab_size = _vocab_size(args.corpus)
    resolve_arms(args)
    if args.worker:
        import torch

        torch.set_num_threads(1)
        model, seed = args.worker.split(":")
        worker(args, model, int(seed))
        return
    held_out = held_out_set(
        args.corpus.valid_prefix, args.corpus.valid_docs, args.eval_samples, args.seq, cache_dir(args.work)
    )
    timing_file = os.path.join(args.work, "timing.json")
    if not args.report_only:
        if not args.timing_only:
            launch_workers(args)
        if args.timing_rounds and (args.timing_only or not os.path.exists(timing_file)):
            if os.environ.get("OMP_NUM_THREADS") != "1":
                raise StudyError("run the timing with OMP_NUM_THREADS=1 (the training runs use one thread each)")
            from tools.p2r_study.timing import timing_run

            write_json(timing_file, timing_run(args))
    timing = read_json(timing_file) if args.timing_rounds and os.path.exists(timing_file) else None
    p2r_report.write(
        load_records(args), timing, args, args.out, sample_documents(held_out, args.eval_samples), args.study_key
    )


def main(argv=None) -> int:
    """Exit status: 0 done, 2 bad input (one ``error:`` line), 1 an OS error (one ``error:`` line)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        run_study(args, argv)
    except (StudyError, *STUDY_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
