"""One arm with one seed: train its phases, convert between them, evaluate every saved checkpoint
on the held-out set, and write the run's record.

Each step is written atomically and skipped when its result exists (a phase's ``evals.json``, a
conversion's ``after.json``, the run's record), so a killed study continues where it stopped
and trains nothing twice.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
import time
from typing import List, Optional

from tools.p2r_study import heldout as p2r_heldout
from tools.p2r_study.arms import Phase


def _key(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:10]


def write_json(path: str, value) -> None:
    """Written whole or not at all: a study killed mid-write leaves no half file behind."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def kind_of(args, model: str, phase: Phase) -> str:
    return f"{model}/{args.shapes[model].layers // phase.shallower}L/{phase.pattern}"


def phase_values(args, model: str, phase: Phase, seed: int, decay_until: float = 1.0) -> dict:
    """Config values of one phase; all phases of a run share one LR schedule, decayed over
    ``decay_until`` x --iters steps (1 except for a compute-matched control)."""
    shape, corpus = args.shapes[model], args.corpus
    return dict(
        num_layers=shape.layers // phase.shallower,
        hidden_size=shape.hidden,
        num_attention_heads=4,
        seq_length=args.seq,
        ffn_hidden_size=4 * shape.hidden,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        tokenizer_type=corpus.tokenizer_type,
        tokenizer_model=corpus.tokenizer_model,
        data_path=[corpus.train_prefix],
        split=corpus.split,
        micro_batch_size=args.micro_batch,
        lr=args.lr,
        min_lr=args.lr / 10,
        lr_warmup_iters=max(args.iters // 25, 1),
        lr_decay_style="cosine",
        lr_decay_iters=max(round(decay_until * args.iters), 1),
        weight_decay=0.01,
        clip_grad=1.0,
        seed=seed,
        log_interval=args.eval_interval,
        eval_iters=0,
        p2r_phase="real" if phase.pattern == "none" else "pseudo",
        share_pattern="all" if phase.pattern == "none" else phase.pattern,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        adam_beta2=0.95,
    )


def model_values(values: dict, vocab_size: int) -> dict:
    """The values of a phase's model alone (no data): for FLOPs and memory plans."""
    return dict(
        values, vocab_size=vocab_size, tokenizer_type=None, tokenizer_model=None, data_path=None, mock_data=True
    )


@functools.lru_cache(maxsize=1)
def _held_out_set(prefix: str, docs: tuple, samples: int, seq_length: int, cache_dir: str):
    """One held-out set per process: every run a worker trains is evaluated on it."""
    return p2r_heldout.held_out_set(prefix, docs, samples, seq_length, cache_dir)


def evaluate_dirs(args, values: dict, iter_dirs: List[str]) -> List[List[float]]:
    """Per-sample held-out losses of each checkpoint."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.checkpoint.io import load_checkpoint
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state, resolve_vocab

    c = args.corpus
    held_out = _held_out_set(
        c.valid_prefix, c.valid_docs, args.eval_samples, args.seq, p2r_heldout.cache_dir(args.work)
    )
    state = build_train_state(resolve_vocab(config_from_values(values)), ParallelState.single())
    out = []
    for d in iter_dirs:
        load_checkpoint(d, state, finetune=True)
        out.append(p2r_heldout.per_sample_losses(state.model, held_out, args.eval_samples, args.micro_batch))
    return out


def _point(step: int, losses: List[float]) -> list:
    return [step, *p2r_heldout.mean_se(losses)]


def train_phase(args, values: dict, phase_dir: str, load: Optional[str], start: int) -> dict:
    """Train one phase (unless done before), evaluate its saved checkpoints, keep only the last.
    Returns {"points": [[step, loss, se]] after ``start``, "last": the last one's per-sample losses}."""
    done = os.path.join(phase_dir, "evals.json")
    if not os.path.exists(done):
        from megatron_p2r.arguments import config_from_values
        from megatron_p2r.training import pretrain

        shutil.rmtree(phase_dir, ignore_errors=True)
        os.makedirs(phase_dir)
        ckpt = os.path.join(phase_dir, "ckpt")
        pretrain(
            config_from_values(
                dict(
                    values,
                    save=ckpt,
                    save_interval=args.eval_interval,
                    load=load,
                    log_file=os.path.join(phase_dir, "log.jsonl"),
                )
            )
        )
        dirs = sorted(glob.glob(os.path.join(ckpt, "iter_*")))
        steps = [int(os.path.basename(d)[5:]) for d in dirs]
        losses = evaluate_dirs(args, values, dirs)
        for d in dirs[:-1]:
            shutil.rmtree(d)
        write_json(
            done,
            {"points": [_point(s, v) for s, v in zip(steps, losses, strict=True) if s > start], "last": losses[-1]},
        )
    return read_json(done)


def convert(args, model: str, phase: Phase, nxt: Phase, phase_dir: str, load: str, values: dict) -> dict:
    """Convert the phase's last checkpoint into the next phase's model (once); its held-out losses."""
    from tools.convert_checkpoint import main as convert_checkpoint

    after = os.path.join(load, "after.json")
    if not os.path.exists(after):
        options = [a.format(rewarmup=max(args.iters // 20, 1)) for a in phase.convert]
        if options[0] == "grow":
            options += ["--num-layers", str(args.shapes[model].layers // nxt.shallower)]
        if nxt.pattern != "none" and "--target-share-pattern" not in options:
            options += ["--target-share-pattern", nxt.pattern]
        shutil.rmtree(load, ignore_errors=True)
        convert_checkpoint([options[0], os.path.join(phase_dir, "ckpt"), load, *options[1:], "--no-progress"])
        losses = evaluate_dirs(args, values, [load])[0]
        write_json(after, {"point": _point(values["train_iters"], losses), "losses": losses})
    return read_json(after)


def run_arm(args, model: str, arm: str, seed: int) -> dict:
    """Every phase of one arm with one seed; returns its record (phases, evaluation points with
    standard errors, the final checkpoint's per-sample losses)."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.metrics import model_flops_per_token

    phases, points, start, load, last = [], [], 0, None, None
    plan = args.arms[model][arm]
    decay = plan[-1].until
    shape = args.shapes[model]
    for i, phase in enumerate(plan):
        end = round(phase.until * args.iters)
        values = dict(phase_values(args, model, phase, seed, decay), train_iters=end)
        phase_dir = os.path.join(
            args.work,
            "runs",
            model,
            f"seed{seed}",
            _key(
                plan[:i],
                phase.until,
                phase.shallower,
                phase.pattern,
                args.iters,
                decay,
                shape.layers,
                shape.hidden,
                args.study_key,
            ),
        )
        print(f"{model} seed {seed} {arm}: phase {i + 1}/{len(plan)}, steps {start}..{end}", flush=True)
        trained = train_phase(args, values, phase_dir, load, start)
        points += trained["points"]
        last = trained["last"]
        cfg = config_from_values(model_values(values, args.vocab_size))
        phases.append(
            {
                "kind": kind_of(args, model, phase),
                "start": start,
                "end": end,
                "flops_per_token": model_flops_per_token(cfg.model),
            }
        )
        if phase.convert:
            nxt = plan[i + 1]
            load = os.path.join(phase_dir, "to_" + _key(plan[: i + 1], nxt))
            after = convert(
                args,
                model,
                phase,
                nxt,
                phase_dir,
                load,
                dict(phase_values(args, model, nxt, seed, decay), train_iters=end),
            )
            points.append(after["point"])
        start = end
    return {
        "model": model,
        "arm": arm,
        "seed": seed,
        "phases": phases,
        "points": points,
        "final_losses": last,
        "tokens_per_step": args.micro_batch * args.seq,
    }


def record_path(args, model: str, arm: str, seed: int) -> str:
    """A run's record, keyed by everything that changes it (``args.study_key``: the data's hash,
    the tokenizer, the held-out set and the training settings, from ``identity``)."""
    shape = args.shapes[model]
    return os.path.join(
        args.work, "records", f"{model}_{_key(arm, shape.layers, shape.hidden, args.study_key)}_seed{seed}.json"
    )


def worker(args, model: str, seed: int) -> None:
    """All arms of one (model, seed), in order (arms share their common first phases)."""
    for arm in args.arms[model]:
        path = record_path(args, model, arm, seed)
        if os.path.exists(path):
            continue
        started = time.monotonic()
        record = run_arm(args, model, arm, seed)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, record)
        print(
            f"{model} seed {seed} {arm}: done in {time.monotonic() - started:.0f} s, final held-out loss "
            f"{record['points'][-1][1]:.3f} ± {record['points'][-1][2]:.3f} (SE)",
            flush=True,
        )
