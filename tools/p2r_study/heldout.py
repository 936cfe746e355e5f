"""The study's held-out set and its per-sample losses.

Every run is evaluated on the same ``--eval-samples`` windows of the held-out documents (drawn
with one fixed seed). A loss is reported with its standard error over those samples, so a
difference between arms can be set against the noise of a finite evaluation set; a paired
difference (two models on the same samples) has the smaller standard error of the per-sample
differences. That SE holds the trained models fixed: samples cut from one document are not
independent (``clustered_se`` counts documents instead), and another seed trains other models
(the report's seed-to-seed SE).
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

EVAL_SEED = 1234


class HeldOutTooSmall(ValueError):
    """More evaluation samples asked for than the held-out documents hold without repeating."""


def held_out_set(prefix: str, docs: Tuple[int, int], samples: int, seq_length: int, cache_dir: str):
    """``samples`` windows of ``seq_length + 1`` tokens from documents [begin, end) of ``prefix``,
    none repeated (a repeated window would understate the standard error)."""
    import numpy as np

    from megatron_p2r.data.gpt_dataset import GPTDataset
    from megatron_p2r.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    begin, end = docs
    tokens = int(ds.sequence_lengths[begin:end].sum(dtype=np.int64))
    available = (tokens - 1) // seq_length
    if samples > available:
        raise HeldOutTooSmall(
            f"--eval-samples {samples}: the held-out documents {begin}..{end - 1} of {prefix} "
            f"hold {tokens:,} tokens, {available} samples of {seq_length} tokens; ask for fewer or "
            "hold out more (--valid-fraction, --valid-data-path)"
        )
    return GPTDataset(ds, np.arange(begin, end), samples, seq_length, EVAL_SEED, cache_dir, "held-out")


def per_sample_losses(model, dataset, samples: int, batch: int) -> List[float]:
    """Each sample's mean next-token loss under ``model`` (one process, no pipeline)."""
    import numpy as np
    import torch

    out: List[float] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, samples, batch):
            rows = [np.asarray(dataset[i], dtype=np.int64) for i in range(start, min(start + batch, samples))]
            tokens = torch.from_numpy(np.stack(rows))
            losses = model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
            out += losses.float().mean(dim=1).tolist()
    model.train()
    return out


def mean_se(values: Sequence[float]) -> Tuple[float, float]:
    """(mean, standard error of the mean): sample std / sqrt(n); 0 for a single value."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def paired_se(a: Sequence[float], b: Sequence[float]) -> float:
    """The standard error of mean(a) - mean(b) for two models evaluated on the same samples."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in number: {len(a)} and {len(b)}")
    return mean_se([x - y for x, y in zip(a, b, strict=True)])[1]


def clustered_se(a: Sequence[float], b: Sequence[float], clusters: Sequence[int]) -> Optional[float]:
    """The standard error of mean(a) - mean(b) with samples grouped by ``clusters`` (the document
    each sample starts in): the cluster-robust (CR1) estimate, sqrt(G/(G-1) * sum over clusters of
    (summed deviations)^2) / n; None with fewer than two clusters."""
    if not len(a) == len(b) == len(clusters):
        raise ValueError(f"clustered samples differ in number: {len(a)}, {len(b)} and {len(clusters)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    sums: Dict[int, float] = {}
    for d, c in zip(diffs, clusters, strict=True):
        sums[c] = sums.get(c, 0.0) + d - mean
    groups = len(sums)
    if groups < 2:
        return None
    return math.sqrt(groups / (groups - 1) * sum(s * s for s in sums.values())) / len(diffs)


def sample_documents(dataset, samples: int) -> List[int]:
    """The document each of the first ``samples`` samples of a GPTDataset starts in."""
    return [int(dataset.doc_idx[dataset.sample_idx[int(dataset.shuffle_idx[i])][0]]) for i in range(samples)]


def cache_dir(work: str) -> str:
    return os.path.join(work, "corpus", "heldout_index")
