"""Batch-size schedules and sample-based training with Megatron-LM's semantics (config/batch.py).

The references below are Megatron-LM's own calculators, reduced to their arithmetic:
``RampupBatchsizeNumMicroBatchesCalculator.update`` and ``update_train_iters`` of core_v0.17
(the last release with the ramp-up), and the step-schedule loop of main at d98e8a64.
"""

import json
import re

import pytest

from megatron_p2r.config import ConfigError, global_batch_size, num_microbatches, train_iters, train_samples, validate
from megatron_p2r.config.batch import lr_lengths, parse_step_schedule
from megatron_p2r.training import pretrain
from tests.helpers import tiny_config


def megatron_rampup_batch(consumed, start, increment, samples, final):
    """core_v0.17 ``RampupBatchsizeNumMicroBatchesCalculator.update`` (its float arithmetic)."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def megatron_rampup_iters(train, start, increment, samples, final):
    """core_v0.17 ``update_train_iters`` with a ramp-up."""
    iterations = consumed = 0
    while consumed <= samples and consumed <= train:
        consumed += megatron_rampup_batch(consumed, start, increment, samples, final)
        iterations += 1
    if train > consumed:
        iterations += (train - consumed) // final
    return iterations


@pytest.mark.parametrize("start, increment, samples, final", [(4, 2, 37, 12), (16, 16, 5859, 1536), (2, 1, 5, 3)])
def test_rampup_is_megatrons(start, increment, samples, final):
    cfg = tiny_config(
        train_iters=None,
        train_samples=samples * 3,
        rampup_batch_size=[start, increment, samples],
        global_batch_size=final,
        micro_batch_size=1,
    )
    for consumed in range(0, samples + 2 * final):
        assert global_batch_size(cfg, 1, consumed) == megatron_rampup_batch(consumed, start, increment, samples, final)
    for train in (1, samples // 2, samples, samples + 1, 3 * samples + final - 1):
        cfg = cfg.replace(train_samples=train)
        assert train_iters(cfg, 1) == megatron_rampup_iters(train, start, increment, samples, final), train


def test_step_schedule_thresholds_are_tokens():
    assert parse_step_schedule(["0:16", "2.4B:320", "12B:1536"], 2048) == [(0, 16), (1171875, 320), (5859375, 1536)]
    assert parse_step_schedule(["0:8,1K:16"], 10) == [(0, 8), (100, 16)]  # one argument, commas as spaces
    assert parse_step_schedule(["0:8", "50:4"], 10) == [(0, 8), (5, 4)]  # shrinking is allowed, as in Megatron
    for bad, message in [
        (["16"], "THRESHOLD:BATCH_SIZE"),
        (["10:16"], "threshold 0"),
        (["0:8", "9:16"], "strictly"),
        (["0:x"], "not a number"),
        (["0:0"], "every batch size must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_step_schedule(bad, 10)


def test_step_schedule_train_iters_follow_megatron():
    cfg = tiny_config(
        train_iters=None,
        train_samples=50,
        step_batch_size_schedule=["0:4", "160:8", "400:12"],
        seq_length=16,
        micro_batch_size=2,
    )  # thresholds 10 and 25 samples
    consumed, iterations, sizes = 0, 0, []
    while consumed < 50:  # Megatron-LM's update_train_iters with a step schedule
        sizes.append(global_batch_size(cfg, 1, consumed))
        consumed, iterations = consumed + sizes[-1], iterations + 1
    assert sizes == [4, 4, 4, 8, 8, 12, 12] and train_iters(cfg, 1) == iterations == 7
    assert train_samples(cfg, 1) == 52  # the last step goes past --train-samples
    assert [num_microbatches(cfg, 2, c) for c in (0, 12, 28)] == [1, 2, 3]  # DP 2, micro-batch 2


def test_constant_batch_sample_counts():
    cfg = tiny_config(train_iters=None, train_samples=30, global_batch_size=4)
    assert (train_iters(cfg, 1), train_samples(cfg, 1)) == (7, 30)  # Megatron floors: 7 steps, 28 samples
    cfg = tiny_config(train_iters=5, global_batch_size=4)
    assert (train_iters(cfg, 1), train_samples(cfg, 1)) == (5, 20)


def test_a_resumed_run_needs_its_consumed_samples_plus_what_its_remaining_steps_consume():
    """A checkpoint from a run with another batch size: its consumed samples differ from what this
    run's schedule would have consumed by then (Megatron-LM carries them over)."""
    cfg = tiny_config(train_iters=4, global_batch_size=8)
    assert train_samples(cfg, 1) == train_samples(cfg, 1, 0, 0) == 32
    assert train_samples(cfg, 1, 2, 32) == 32 + 2 * 8  # two steps of 16 before, two of 8 now
    cfg = tiny_config(train_iters=6, step_batch_size_schedule=["0:2", "160:4"], seq_length=16)  # 4 from sample 10
    assert train_samples(cfg, 1) == 5 * 2 + 4
    assert train_samples(cfg, 1, 3, 12) == 12 + 3 * 4  # past the threshold already
    assert train_samples(cfg, 1, 3, 4) == 4 + 3 * 2  # 4, 6, 8 consumed before each: all below it


def test_lr_lengths_in_samples():
    iters = tiny_config(train_iters=10, lr_decay_iters=8, lr_warmup_iters=2, global_batch_size=4)
    assert lr_lengths(iters, 1) == (8, 32)
    assert lr_lengths(iters.replace(lr_warmup_iters=0, lr_warmup_fraction=0.25), 1) == (8.0, 32)
    samples = tiny_config(train_iters=None, train_samples=40, lr_warmup_samples=3, global_batch_size=4)
    assert lr_lengths(samples, 1) == (3, 40)
    assert lr_lengths(samples.replace(lr_decay_samples=20), 1) == (3, 20)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(train_samples=8), "--train-iters and --train-samples are mutually exclusive"),
        (dict(lr_decay_samples=8), "--lr-decay-samples / --lr-warmup-samples need --train-samples"),
        (dict(train_iters=None, train_samples=8, lr_warmup_iters=1), "--lr-decay-iters / --lr-warmup-iters need"),
        (dict(lr_warmup_iters=1, lr_warmup_fraction=0.1), "--lr-warmup-fraction and --lr-warmup-iters"),
        (dict(rampup_batch_size=[2, 2, 8], global_batch_size=4), "--rampup-batch-size needs sample-based training"),
        (
            dict(train_iters=None, train_samples=8, rampup_batch_size=[2, 2, 8], step_batch_size_schedule=["0:2"]),
            "mutually exclusive",
        ),
        (
            dict(train_iters=None, train_samples=8, rampup_batch_size=[2, 3, 8], global_batch_size=4),
            "positive multiple of the increment",
        ),
        (dict(step_batch_size_schedule=["0:2", "64:4"], global_batch_size=8), "differs from the last batch size"),
        (dict(lr_warmup_iters=10), "warm-up (20 samples) must end before the decay length (20 samples"),
        (dict(decoupled_min_lr=1e-3), "--decoupled-min-lr needs --decoupled-lr"),
    ],
)
def test_schedule_rules(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(tiny_config(**values), 1)


def test_scheduled_batch_must_split_into_micro_batches():
    cfg = tiny_config(step_batch_size_schedule=["0:2", "64:6"], micro_batch_size=2, global_batch_size=6)
    with pytest.raises(ConfigError, match=r"--global-batch-size \(6\) must be divisible"):
        validate(cfg, 2)
    cfg = cfg.replace(step_batch_size_schedule=["0:2", "64:8"], global_batch_size=8)
    validate(cfg, 2)  # Megatron checks a scheduled size when the run reaches it
    with pytest.raises(ConfigError, match=r"--step-batch-size-schedule: a global batch of 2 is not divisible"):
        num_microbatches(cfg, 2, 0)


def _run(tmp_path, save: str, log: str, **values) -> list:
    cfg = tiny_config(
        train_iters=None,
        train_samples=40,
        rampup_batch_size=[2, 2, 20],
        global_batch_size=8,
        micro_batch_size=2,
        lr_decay_style="cosine",
        lr_warmup_samples=6,
        save=str(tmp_path / save),
        hidden_dropout=0.1,
        log_file=str(tmp_path / log),
        **values,
    )
    pretrain(cfg)
    return [json.loads(line) for line in open(tmp_path / log) if "lm_loss" in line]


def test_rampup_resume_mid_ramp_is_exact(tmp_path):
    """Micro-batches per step grow with the consumed samples; a run stopped at iteration 3
    (mid-ramp) and resumed logs exactly what the straight run logs."""
    straight = _run(tmp_path, "a", "a.jsonl")
    sizes = [r["global_batch_size"] for r in straight]
    assert sizes == sorted(sizes) and (sizes[0], sizes[-1]) == (2, 8) and len(set(sizes)) == 4
    assert len(straight) == megatron_rampup_iters(40, 2, 2, 20, 8)
    first = _run(tmp_path, "b", "b1.jsonl", exit_interval=3)
    second = _run(tmp_path, "b", "b2.jsonl", load=str(tmp_path / "b"))
    assert [r["iteration"] for r in first + second] == list(range(1, len(straight) + 1))
    keys = ("lm_loss", "lr", "grad_norm", "consumed_samples", "global_batch_size")
    assert [[r[k] for k in keys] for r in first + second] == [[r[k] for k in keys] for r in straight]
