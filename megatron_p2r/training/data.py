"""The data a run reads: its datasets and this data-parallel rank's micro-batches."""

from __future__ import annotations

from typing import Iterator, List

import numpy as np
import torch

from megatron_p2r.config import Config, global_batch_size, train_samples
from megatron_p2r.parallel.state import ParallelState


def build_datasets(cfg: Config, ps: ParallelState, iteration: int = 0, consumed_samples: int = 0):
    """(train, valid) datasets: every item is int64 tokens of length seq_length + 1; no training
    set for a run that trains nothing (--eval-only), no validation set with --eval-iters 0.

    A resumed run's training set holds the samples consumed so far plus those of its remaining
    iterations (``config.batch.train_samples``): the same size as before when the global batch
    size is unchanged, and enough when a resumed run changes it."""
    eval_samples = cfg.logging.eval_iters * global_batch_size(cfg, ps.layout.world_size)
    samples = 0 if cfg.logging.eval_only else train_samples(cfg, ps.layout.world_size, iteration, consumed_samples)
    if cfg.data.mock_data:
        from megatron_p2r.data.mock import MockGPTDataset

        m = cfg.model
        return (
            MockGPTDataset(samples, m.seq_length, m.vocab_size, cfg.train.seed) if samples else None,
            MockGPTDataset(eval_samples, m.seq_length, m.vocab_size, cfg.train.seed + 1) if eval_samples else None,
        )
    from megatron_p2r.data.builder import build_train_valid_test_datasets

    train, valid, _ = build_train_valid_test_datasets(
        cfg.data, cfg.model.seq_length, cfg.train.seed, (samples, eval_samples, 0), cfg.model.vocab_size
    )
    return train, valid


def microbatch_iterator(dataset, consumed_samples: int, cfg: Config, ps: ParallelState) -> Iterator[dict]:
    """This data-parallel rank's micro-batches, continuing after ``consumed_samples``; under
    context parallelism the CP ranks of a DP rank read the same samples and each keeps its two
    chunks of every sequence (``context.chunks``)."""
    from megatron_p2r.context.chunks import split_batch
    from megatron_p2r.data.samplers import PretrainingSampler

    sampler = PretrainingSampler(len(dataset), consumed_samples, cfg.train.micro_batch_size, ps.dp_rank, ps.dp_size)
    for indices in sampler:
        sample = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices]))
        sample = sample.to(ps.device)
        batch = {
            "tokens": sample[:, :-1],
            "labels": sample[:, 1:],
            "loss_mask": torch.ones_like(sample[:, 1:], dtype=torch.float32),
        }
        yield split_batch(batch, ps.cp_size, ps.cp_rank)


def take(iterator: Iterator[dict], n: int, what: str) -> List[dict]:
    """The next ``n`` micro-batches of ``iterator`` (the ``what`` data), or an error saying it ran out."""
    batches = [b for _, b in zip(range(n), iterator, strict=False)]
    if len(batches) < n:
        raise RuntimeError(f"the {what} data ran out: needed {n} micro-batches, got {len(batches)}")
    return batches
