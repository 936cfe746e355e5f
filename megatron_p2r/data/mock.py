"""Synthetic data for runs without a corpus (``--mock-data``).

Each sample is an arithmetic progression modulo the vocabulary with its own start and a
small step, drawn from a generator seeded by (seed, index): deterministic, independent of
the order samples are read in, and learnable (after two tokens the rest follows), so a
falling loss on mock data shows the model and optimiser work.
"""

from __future__ import annotations

import numpy as np

MAX_STEP = 8


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        if num_samples < 1 or seq_length < 1 or vocab_size < 2:
            raise ValueError(
                f"need num_samples >= 1, seq_length >= 1, vocab_size >= 2; "
                f"got {num_samples}, {seq_length}, {vocab_size}"
            )
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        self._positions = np.arange(seq_length + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, int(idx)])
        start = rng.integers(self.vocab_size)
        step = rng.integers(1, min(MAX_STEP, self.vocab_size - 1) + 1)
        return (start + step * self._positions) % self.vocab_size
