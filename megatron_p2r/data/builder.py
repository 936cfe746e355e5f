"""Train/valid/test datasets from ``--data-path``, ``--split`` and ``--data-cache-path``.

Each prefix is split by contiguous ranges of its documents (Megatron-LM's rule: the split
``969,30,1`` becomes cumulative bounds 0, .969, .999, 1 times the document count, rounded).
With several weighted prefixes each split is the blend of that split of every prefix, and
each prefix is asked for exactly the samples the blend takes from it.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.config.data import parse_split
from megatron_p2r.data.blended import BlendedDataset, blending_indices
from megatron_p2r.data.gpt_dataset import GPTDataset, token_range
from megatron_p2r.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], List[float]]:
    """``["A"]`` -> ([A], [1.0]); ``["0.3", "A", "0.7", "B"]`` -> ([A, B], [0.3, 0.7])."""
    if not data_path:
        raise ConfigError("--data-path is empty")
    if len(data_path) == 1:
        return [data_path[0]], [1.0]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path with several datasets takes weight/prefix pairs "
                          f"(0.3 A 0.7 B), got {len(data_path)} items: {' '.join(data_path)}")
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[0::2], data_path[1::2], strict=True):
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path: expected a weight before {prefix}, got {weight!r}") from None
        if not value > 0:
            raise ConfigError(f"--data-path: the weight of {prefix} must be positive, got {weight}")
        weights.append(value)
        prefixes.append(prefix)
    return prefixes, weights


def split_ranges(fractions: Sequence[float], count: int) -> List[Tuple[int, int]]:
    bounds = np.concatenate(([0.0], np.cumsum(fractions)))
    edges = [int(round(b * count)) for b in bounds]
    edges[-1] = count
    return list(zip(edges[:-1], edges[1:], strict=False))


def _open_indexed(prefix: str, data_cfg: DataConfig, vocab_size: Optional[int]) -> IndexedDataset:
    """The dataset at ``prefix``, its token ids checked against the vocabulary: an id past it would
    crash the embedding lookup (TP1) or train on another rank's rows (TP>1)."""
    for path in (index_file_path(prefix), data_file_path(prefix)):
        if not os.path.isfile(path):
            raise ConfigError(f"--data-path {prefix}: {path} not found (make it with tools/preprocess_data.py)")
    try:
        ds = IndexedDataset(prefix)
    except ValueError as exc:
        raise ConfigError(f"--data-path {prefix}: {exc}") from None
    if ds.dtype.kind not in "iu":
        raise ConfigError(f"--data-path {prefix}: tokens are stored as {ds.dtype.name}; token ids are integers")
    if vocab_size is not None:
        lo, hi = token_range(ds, _cache_dir(data_cfg, prefix))
        if lo < 0 or hi >= vocab_size:
            raise ConfigError(f"--data-path {prefix}: token ids run from {lo} to {hi}, but the vocabulary has "
                              f"{vocab_size} ids (--vocab-size or the tokenizer's); was it preprocessed with "
                              "another tokenizer?")
    return ds


def _cache_dir(data_cfg: DataConfig, prefix: str) -> str:
    if data_cfg.data_cache_path:
        return data_cfg.data_cache_path
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def build_train_valid_test_datasets(data_cfg: DataConfig, seq_length: int, seed: int,
                                    num_samples: Tuple[int, int, int], vocab_size: Optional[int] = None):
    """(train, valid, test); a split asked for 0 samples is None. With ``vocab_size`` every
    dataset's token ids must lie in [0, vocab_size)."""
    prefixes, weights = parse_data_path(data_cfg.data_path)
    fractions = parse_split(data_cfg.split)
    indexed = [_open_indexed(p, data_cfg, vocab_size) for p in prefixes]
    ranges = [split_ranges(fractions, len(ds)) for ds in indexed]
    result: List[Optional[object]] = []
    for s, (name, count) in enumerate(zip(SPLIT_NAMES, num_samples, strict=True)):
        if count <= 0:
            result.append(None)
            continue
        blend_cache = _cache_dir(data_cfg, prefixes[0])
        if len(prefixes) == 1:
            per_dataset = [count]
        else:
            dataset_index, _ = blending_indices(weights, count, blend_cache)
            per_dataset = np.bincount(dataset_index, minlength=len(prefixes)).tolist()
        parts = []
        for prefix, ds, r, n in zip(prefixes, indexed, ranges, per_dataset, strict=True):
            begin, end = r[s]
            if n == 0:  # a small blend may take nothing from a light dataset; keep the position
                parts.append(None)
                continue
            if begin == end:
                raise ConfigError(f"--split {data_cfg.split}: the {name} split of --data-path {prefix} has 0 of "
                                  f"its {len(ds)} documents, but {n} {name} samples are needed from it")
            try:
                parts.append(GPTDataset(ds, np.arange(begin, end), n, seq_length, seed,
                                        _cache_dir(data_cfg, prefix), name))
            except ValueError as exc:
                raise ConfigError(f"--data-path {prefix}: {exc}") from None
        if len(parts) == 1:
            result.append(parts[0])
        else:
            # () stands in for a dataset the blend takes no sample from.
            result.append(BlendedDataset([p if p is not None else () for p in parts], weights, count, blend_cache))
    return tuple(result)
