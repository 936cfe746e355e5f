"""Train/valid/test datasets from ``--data-path``, ``--split`` and ``--data-cache-path``, or
from each split's own prefixes (``--train-data-path`` ..., ``--per-split-data-args-path``).

Each prefix is split by contiguous ranges of its documents (Megatron-LM's rule: the split
``969,30,1`` becomes cumulative bounds 0, .969, .999, 1 times the document count, rounded).
With several weighted prefixes each split is the blend of that split of every prefix, and
each prefix is asked for exactly the samples the blend takes from it. A split with prefixes of
its own takes all their documents (Megatron-LM's ``blend_per_split``); samples asked of a split
given none are an error.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.config.data import parse_split
from megatron_p2r.data.blended import BlendedDataset, blending_indices
from megatron_p2r.data.gpt_dataset import GPTDataset, token_range
from megatron_p2r.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megatron_p2r.files import MiB, read_bounded

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], List[float]]:
    """``["A"]`` -> ([A], [1.0]); ``["0.3", "A", "0.7", "B"]`` -> ([A, B], [0.3, 0.7])."""
    if not data_path:
        raise ConfigError("--data-path is empty")
    if len(data_path) == 1:
        return [data_path[0]], [1.0]
    if len(data_path) % 2:
        raise ConfigError(
            f"--data-path with several datasets takes weight/prefix pairs "
            f"(0.3 A 0.7 B), got {len(data_path)} items: {' '.join(data_path)}"
        )
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
            raise ConfigError(
                f"--data-path {prefix}: token ids run from {lo} to {hi}, but the vocabulary has "
                f"{vocab_size} ids (--vocab-size or the tokenizer's); was it preprocessed with "
                "another tokenizer?"
            )
    return ds


def _cache_dir(data_cfg: DataConfig, prefix: str) -> str:
    if data_cfg.data_cache_path:
        return data_cfg.data_cache_path
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


# (prefixes, weights, [train, valid, test] fractions of their documents) of one split; None: no data.
Blend = Optional[Tuple[List[str], List[float], List[float]]]
ARGS_FILE_LIMIT = 16 * MiB  # a list of prefixes


def _read_args_file(path: str, flag: str) -> str:
    try:
        return read_bounded(path, ConfigError, ARGS_FILE_LIMIT, flag).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{flag}: no such file: {path}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


def _per_split_paths(data_cfg: DataConfig) -> List[Optional[List[str]]]:
    """Each split's --data-path words, from the flags or the JSON file (a list, a string, null)."""
    path = data_cfg.per_split_data_args_path
    if path is None:
        return [data_cfg.train_data_path, data_cfg.valid_data_path, data_cfg.test_data_path]
    try:
        table = json.loads(_read_args_file(path, "--per-split-data-args-path"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--per-split-data-args-path {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(table, dict) or any(name not in table for name in SPLIT_NAMES):
        raise ConfigError(f'--per-split-data-args-path {path}: expected {{"train": ..., "valid": ..., "test": ...}}')
    out = []
    for name in SPLIT_NAMES:
        value = table[name]
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(
                f"--per-split-data-args-path {path}: {name!r} must be a list of strings, a string or "
                f"null, got {value!r}"
            )
        out.append(value)
    return out


def split_blends(data_cfg: DataConfig) -> List[Blend]:
    """What each of train, valid and test reads (Megatron-LM's get_blend_and_blend_per_split)."""
    if data_cfg.per_split:
        return [
            (*parse_data_path(words), [float(s == i) for i in range(3)]) if words else None
            for s, words in enumerate(_per_split_paths(data_cfg))
        ]
    words = data_cfg.data_path
    if data_cfg.data_args_path is not None:
        words = _read_args_file(data_cfg.data_args_path, "--data-args-path").split()
    return [(*parse_data_path(words), parse_split(data_cfg.split))] * 3


def build_train_valid_test_datasets(
    data_cfg: DataConfig,
    seq_length: int,
    seed: int,
    num_samples: Tuple[int, int, int],
    vocab_size: Optional[int] = None,
):
    """(train, valid, test); a split asked for 0 samples is None. With
    ``vocab_size`` every dataset's token ids must lie in [0, vocab_size)."""
    blends = split_blends(data_cfg)
    opened = {}
    result: List[Optional[object]] = []
    for s, (name, count, blend) in enumerate(zip(SPLIT_NAMES, num_samples, blends, strict=True)):
        if count <= 0:
            result.append(None)
            continue
        if blend is None:  # Megatron-LM would silently skip the evaluation asked for
            raise ConfigError(
                f"{count} {name} samples are asked for (--eval-iters), but the per-split paths give "
                f"the {name} split no prefixes: give --{name}-data-path, or --eval-iters 0"
            )
        prefixes, weights, fractions = blend
        for prefix in prefixes:
            if prefix not in opened:
                opened[prefix] = _open_indexed(prefix, data_cfg, vocab_size)
        result.append(_split_dataset(data_cfg, name, s, count, prefixes, weights, fractions, opened, seq_length, seed))
    return tuple(result)


def _split_dataset(
    data_cfg: DataConfig,
    name: str,
    s: int,
    count: int,
    prefixes: List[str],
    weights: List[float],
    fractions: List[float],
    opened: dict,
    seq_length: int,
    seed: int,
):
    """Split ``s``: its part of each prefix, blended by ``weights`` when there are several."""
    blend_cache = _cache_dir(data_cfg, prefixes[0])
    if len(prefixes) == 1:
        per_dataset = [count]
    else:
        dataset_index, _ = blending_indices(weights, count, blend_cache)
        per_dataset = np.bincount(dataset_index, minlength=len(prefixes)).tolist()
    parts = []
    for prefix, n in zip(prefixes, per_dataset, strict=True):
        ds = opened[prefix]
        begin, end = split_ranges(fractions, len(ds))[s]
        if n == 0:  # a small blend may take nothing from a light dataset; keep the position
            parts.append(None)
            continue
        if begin == end:
            raise ConfigError(
                f"--split {data_cfg.split}: the {name} split of --data-path {prefix} has 0 of "
                f"its {len(ds)} documents, but {n} {name} samples are needed from it"
            )
        try:
            parts.append(GPTDataset(ds, np.arange(begin, end), n, seq_length, seed, _cache_dir(data_cfg, prefix), name))
        except ValueError as exc:
            raise ConfigError(f"--data-path {prefix}: {exc}") from None
    if len(parts) == 1:
        return parts[0]
    # () stands in for a dataset the blend takes no sample from.
    return BlendedDataset([p if p is not None else () for p in parts], weights, count, blend_cache)
