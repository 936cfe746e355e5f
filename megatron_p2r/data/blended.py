"""Blending several datasets with weights (``--data-path 0.3 A 0.7 B``).

Megatron-LM's greedy rule: sample i comes from the dataset furthest behind its share,
``argmax_d(w_d * max(i, 1) - taken_d)``. Every prefix of the blend then holds each dataset
within one sample of its exact share, so proportions hold over any window, not just on
average.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron_p2r.data.gpt_dataset import cached_arrays


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blending weights must be positive numbers, got {list(weights)}")
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index): which dataset sample i comes from, and which of its samples."""
    w = normalize_weights(weights).tolist()
    others = range(1, len(w))
    taken = [0] * len(w)
    dataset_index, dataset_sample_index = [], []
    for i in range(num_samples):
        step = float(max(i, 1))
        best, best_error = 0, w[0] * step - taken[0]
        for d in others:  # strict '>' keeps the first of equal errors, as Megatron does
            error = w[d] * step - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(taken[best])
        taken[best] += 1
    dataset_index = np.asarray(dataset_index, dtype=np.int16 if len(w) < 2**15 else np.int32)
    dataset_sample_index = np.asarray(dataset_sample_index, dtype=np.int64)
    return dataset_index, dataset_sample_index


def blending_indices(weights: Sequence[float], num_samples: int, cache_dir: Optional[str] = None):
    """build_blending_indices, cached on disk under ``cache_dir`` when given."""
    w = normalize_weights(weights)
    description = {"class": "BlendedDataset", "weights": w.tolist(), "num_samples": int(num_samples)}
    return cached_arrays(
        cache_dir,
        "blend",
        ("dataset_index", "dataset_sample_index"),
        description,
        lambda: build_blending_indices(w, num_samples),
    )


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights``."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int, cache_dir: Optional[str] = None):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.dataset_index, self.dataset_sample_index = blending_indices(weights, num_samples, cache_dir)
        for d, ds in enumerate(self.datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(ds):
                raise ValueError(f"blended dataset {d} has {len(ds)} samples, the blend needs {needed}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < len(self):
            raise IndexError(f"blended sample {idx} out of range [0, {len(self)})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
