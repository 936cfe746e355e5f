"""Batch arithmetic: the global batch size after a number of consumed samples, micro-batches
per step, and how many steps a run takes.

Megatron-LM's semantics (docs/megatron.md). The global batch is constant unless
``--step-batch-size-schedule "0:16 2.4B:320 ..."`` (thresholds in *tokens*, as Megatron passes
``seq_length``: a threshold counts as ``tokens // seq_length`` samples) or
``--rampup-batch-size START INCR SAMPLES`` (Megatron core_v0.17's ramp-up; current Megatron
ignores it) makes it grow. Both become one list of (first consumed sample, global batch size)
steps, so the batch size a step uses depends only on the samples consumed before it, which a
checkpoint records: a run resumed mid-ramp continues exactly.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from megatron_p2r.config.fields import ConfigError

if TYPE_CHECKING:
    from megatron_p2r.config.root import Config

BatchSteps = List[Tuple[int, int]]  # (first consumed sample, global batch size), thresholds increasing
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(entries: Sequence[str], seq_length: int) -> BatchSteps:
    """``["0:768", "250B:1536"]`` -> [(0, 768), (250e9 // seq_length, 1536)], as Megatron's
    ``StepBatchsizeNumMicroBatchesCalculator`` parses its string (commas count as spaces). The
    entries may come as one argument or several: Megatron-LM's GPT-3 script passes them split."""
    text = " ".join(entries)
    flag = f"--step-batch-size-schedule {text!r}"
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, size = entry.partition(":")
        if not sep:
            raise ConfigError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        steps.append((_count(threshold, flag) // seq_length, _count(size, flag)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ConfigError(f"{flag}: the first entry must have threshold 0")
    for (before, _), (after, _) in zip(steps, steps[1:], strict=False):
        if after <= before:
            raise ConfigError(
                f"{flag}: thresholds must be strictly increasing (in samples of "
                f"--seq-length {seq_length}), got {before} then {after}"
            )
    if any(size < 1 for _, size in steps):
        raise ConfigError(f"{flag}: every batch size must be >= 1")
    return steps


def _count(text: str, flag: str) -> int:
    """``2.4B`` -> 2400000000 (suffixes K, M, B, T)."""
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([KMBT]?)", text.strip().upper())
    if not match:
        raise ConfigError(f"{flag}: {text!r} is not a number (with an optional K, M, B or T suffix)")
    return int(float(match.group(1)) * _SUFFIXES.get(match.group(2), 1))


def rampup_steps(start: int, increment: int, samples: int, final: int) -> BatchSteps:
    """Megatron's ramp-up as steps: the batch is ``start + k * increment`` once
    ``consumed >= k * samples / n`` (n = (final - start) / increment increments), ``final`` after."""
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"{flag}: the start batch and the increment must be >= 1 and the samples >= 0")
    if final <= start or (final - start) % increment:
        raise ConfigError(
            f"{flag}: the global batch size ({final}) minus the start must be a positive multiple of the increment"
        )
    increments = (final - start) // increment
    # int(consumed / (samples / n)) >= k  <=>  consumed >= ceil(k * samples / n), in integers
    return [(-(-k * samples // increments), start + k * increment) for k in range(increments + 1)]


def batch_steps(cfg: "Config", world_size: int) -> BatchSteps:
    """The run's global batch sizes by consumed samples (one entry when it is constant)."""
    t = cfg.train
    if t.step_batch_size_schedule is not None:
        return parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    final = t.global_batch_size or t.micro_batch_size * data_parallel_size(cfg, world_size)
    if t.rampup_batch_size is not None:
        return rampup_steps(*t.rampup_batch_size, final)
    return [(0, final)]


def data_parallel_size(cfg: "Config", world_size: int) -> int:
    """Ranks reading different samples: the world over TP x PP x CP (the CP ranks of a sample read
    its chunks)."""
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)


def global_batch_size(cfg: "Config", world_size: int, consumed_samples: Optional[int] = None) -> int:
    """The global batch of the step after ``consumed_samples``; unset: the final one (what
    evaluation, the planner and iteration-based LR lengths use)."""
    steps = batch_steps(cfg, world_size)
    return steps[-1][1] if consumed_samples is None else _size_at(steps, consumed_samples)


def _size_at(steps: BatchSteps, consumed: int) -> int:
    return [size for first, size in steps if consumed >= first][-1]


def num_microbatches(cfg: "Config", world_size: int, consumed_samples: Optional[int] = None) -> int:
    """Micro-batches per data-parallel rank in that step; a batch size that does not split into
    micro-batch x DP is an error naming the flag that asked for it."""
    gbs = global_batch_size(cfg, world_size, consumed_samples)
    per_step = cfg.train.micro_batch_size * data_parallel_size(cfg, world_size)
    if gbs % per_step:
        t = cfg.train
        flag = (
            "--step-batch-size-schedule"
            if t.step_batch_size_schedule is not None
            else "--rampup-batch-size"
            if t.rampup_batch_size is not None
            else "--global-batch-size"
        )
        raise ConfigError(
            f"{flag}: a global batch of {gbs} is not divisible by --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({per_step // t.micro_batch_size})"
        )
    return gbs // per_step


def consume(steps: BatchSteps, iterations: Optional[int] = None, until: Optional[int] = None) -> Tuple[int, int]:
    """(steps taken, samples consumed) from the start, stopping after ``iterations`` steps or
    at the first step that reaches ``until`` samples; segment by segment, not step by step."""
    done = consumed = 0
    for index, (_, size) in enumerate(steps):
        limits = [steps[index + 1][0] - consumed] if index + 1 < len(steps) else []
        if until is not None:
            limits.append(until - consumed)
        n = min([-(-limit // size) for limit in limits] + ([iterations - done] if iterations is not None else []))
        n = max(n, 0)
        done, consumed = done + n, consumed + n * size
        if (iterations is not None and done >= iterations) or (until is not None and consumed >= until):
            break
    return done, consumed


def train_iters(cfg: "Config", world_size: int) -> int:
    """Optimizer steps of the run: --train-iters, or Megatron's count for --train-samples."""
    t = cfg.train
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is None:
        return 0
    steps = batch_steps(cfg, world_size)
    if t.rampup_batch_size is not None:  # core_v0.17: ramp-up steps, then whole final batches
        done, consumed = consume(steps, until=min(t.rampup_batch_size[2], t.train_samples) + 1)
        return done + max(t.train_samples - consumed, 0) // steps[-1][1]
    if len(steps) == 1:
        return t.train_samples // steps[0][1]
    return consume(steps, until=t.train_samples)[0]


def train_samples(cfg: "Config", world_size: int, iteration: int = 0, consumed_samples: int = 0) -> int:
    """Samples the training set must hold: --train-samples (Megatron's request) or what the
    steps consume, whichever is larger (a last step may go past --train-samples). A run resumed
    at ``iteration`` continues after its ``consumed_samples`` (Megatron-LM carries them over
    when the global batch size changed): those plus what its remaining steps consume from there."""
    steps = batch_steps(cfg, world_size)
    ahead = [(0, _size_at(steps, consumed_samples))] + [
        (first - consumed_samples, size) for first, size in steps if first > consumed_samples
    ]
    remaining = max(train_iters(cfg, world_size) - iteration, 0)
    return max(consumed_samples + consume(ahead, iterations=remaining)[1], cfg.train.train_samples or 0)


def scheduled_samples(cfg: "Config", world_size: int, iterations: int) -> int:
    """Samples the run's batch sizes consume in their first ``iterations`` steps (what a resumed
    run has consumed unless its batch size changed)."""
    return consume(batch_steps(cfg, world_size), iterations=iterations)[1]


def lr_lengths(cfg: "Config", world_size: int) -> Tuple[float, int]:
    """(warm-up, decay) of the LR schedule in samples, as Megatron-LM counts them: iterations
    times the (final) global batch size, or the sample flags; --lr-warmup-fraction of the decay."""
    t = cfg.train
    if t.train_samples is not None:
        decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
        warmup: float = t.lr_warmup_samples
    else:
        gbs = global_batch_size(cfg, world_size)
        decay = (t.lr_decay_iters if t.lr_decay_iters is not None else train_iters(cfg, world_size)) * gbs
        warmup = t.lr_warmup_iters * gbs
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return warmup, decay
