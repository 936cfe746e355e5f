"""GPT training samples: windows of seq_length+1 tokens that run across document boundaries.

The indices follow Megatron-LM's GPTDataset exactly, so a seed gives the same sample order
here as there:

- ``doc_idx``: the split's documents repeated for as many epochs as the requested samples
  need, shuffled with ``np.random.RandomState(seed)``; when the last epoch contributes under
  80% of an epoch's samples it is shuffled on its own, so a short tail still sees a uniform
  sample of documents rather than whatever the first epochs left over.
- ``sample_idx[i] = (position in doc_idx, token offset)`` where sample i starts; sample i
  ends on the first token of sample i+1 (inputs and labels overlap by one token).
- ``shuffle_idx``: a permutation of the samples (the separate last epoch again separately).

Megatron builds ``sample_idx`` with a C++ loop; here it is one ``np.searchsorted`` over the
cumulative token count. The three arrays are cached as ``.npy`` files whose name carries a
hash of everything they depend on, so a change of data, split, seed, length or count builds
new ones and a rerun loads them memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from typing import Callable, Optional, Tuple

import numpy as np

from megatron_p2r.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

logger = logging.getLogger(__name__)

INDEX_VERSION = 1  # bump when the index construction changes, so old caches are not reused
_SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens make num_samples windows of seq_length+1 (overlapping by one)."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_doc_idx(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    if separate_last_epoch:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    dtype = np.int32 if len(documents) == 0 or documents.max() < 2**31 else np.int64
    doc_idx = np.tile(documents.astype(dtype), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(num_samples+1, 2) array of (doc_idx position, offset): sample i starts at token i*seq_length."""
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if starts[-1] >= ends[-1]:
        raise ValueError(f"{num_samples} samples of {seq_length}+1 tokens need more than the {ends[-1]} tokens given")
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    dtype = np.int32 if len(doc_idx) < 2**31 else np.int64
    sample_idx = np.stack((position, offset), axis=1).astype(dtype)
    sample_idx[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return sample_idx


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples), then a separate one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's (doc_idx, sample_idx, shuffle_idx) for ``num_samples`` samples (or more)."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the {len(documents)} documents hold no tokens")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last_epoch = False
    if num_epochs > 1:
        samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = num_samples - samples_before_last < int(
            _SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch
        )
    rng = np.random.RandomState(seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, total)
    shuffled = samples_before_last if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(shuffled, total, rng)
    return doc_idx, sample_idx, shuffle_idx


def _write_atomically(path: str, write) -> None:
    """``write(file)`` into a new temporary file (O_EXCL: never through a link planted anywhere),
    then rename it over ``path`` (replacing a link there, not writing through it), so concurrent
    ranks never read a partial file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _load_cached(paths, valid: Optional[Callable]) -> Optional[tuple]:
    """The cached arrays when every file is a regular file numpy reads without unpickling and
    ``valid`` accepts them; None (with a warning) when they must be rebuilt."""
    if not all(os.path.isfile(p) and not os.path.islink(p) for p in paths):  # FIFOs and links: rebuilt
        return None
    try:
        arrays = tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
    except ValueError as exc:  # truncated, foreign, or an object (pickle) array: never unpickled
        warnings.warn(f"dataset index cache {paths[0]}... is unreadable ({exc}); rebuilding it")
        return None
    if valid is not None and not valid(arrays):
        warnings.warn(f"dataset index cache {paths[0]}... does not fit its dataset; rebuilding it")
        return None
    return arrays


def cached_arrays(
    cache_dir: Optional[str], stem: str, names: tuple, description: dict, build, valid: Optional[Callable] = None
):
    """Load ``names`` arrays from ``cache_dir/stem-<hash>-<name>.npy``, or ``build()`` and save them.

    The hash covers ``description`` (every input of ``build``, as JSON); ``valid(arrays)`` checks
    loaded arrays against what they index. Without a cache_dir, or when it cannot be written, the
    arrays are built and kept in memory.
    """
    if cache_dir is None:
        return build()
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode(), usedforsecurity=False).hexdigest()
    paths = [os.path.join(cache_dir, f"{stem}-{digest}-{name}.npy") for name in names]
    loaded = _load_cached(paths, valid)
    if loaded is not None:
        return loaded
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for path, array in zip(paths, arrays, strict=True):
            _write_atomically(path, lambda f, a=array: np.save(f, a, allow_pickle=False))
        text = json.dumps(description, indent=1, sort_keys=True).encode()
        _write_atomically(os.path.join(cache_dir, f"{stem}-{digest}-description.json"), lambda f: f.write(text))
    except OSError as exc:
        warnings.warn(f"cannot cache dataset indices in {cache_dir} ({exc}); they are rebuilt on every run")
    return arrays


def _indices_fit(num_documents: int):
    """Whether loaded (doc_idx, sample_idx, shuffle_idx) index a dataset of ``num_documents``:
    shapes that belong together and every index in range, so a stale or foreign cache is rebuilt
    instead of reading out of range mid-run."""

    def check(arrays) -> bool:
        doc_idx, sample_idx, shuffle_idx = arrays
        if doc_idx.ndim != 1 or sample_idx.ndim != 2 or sample_idx.shape[1:] != (2,) or shuffle_idx.ndim != 1:
            return False
        if not all(a.dtype.kind in "iu" for a in arrays) or len(sample_idx) < 2 or not len(doc_idx):
            return False
        return (
            len(shuffle_idx) == len(sample_idx) - 1
            and 0 <= doc_idx.min()
            and doc_idx.max() < num_documents
            and 0 <= sample_idx.min()
            and sample_idx[:, 0].max() < len(doc_idx)
            and 0 <= shuffle_idx.min()
            and shuffle_idx.max() < len(shuffle_idx)
        )

    return check


def token_range(dataset: IndexedDataset, cache_dir: Optional[str]) -> Tuple[int, int]:
    """(smallest, largest) token id of ``dataset``: one pass over its ``.bin`` the first time,
    cached beside the sample indices (keyed by the files' sizes and modification times)."""
    prefix = dataset.path_prefix
    b, i = os.stat(data_file_path(prefix)), os.stat(index_file_path(prefix))
    description = {
        "class": "TokenRange",
        "version": INDEX_VERSION,
        "dtype": dataset.dtype.str,
        "bin": [b.st_size, b.st_mtime_ns],
        "idx": [i.st_size, i.st_mtime_ns],
    }
    (found,) = cached_arrays(
        cache_dir,
        f"{os.path.basename(prefix)}-tokens",
        ("range",),
        description,
        lambda: (dataset.token_range(),),
        lambda arrays: arrays[0].shape == (2,) and arrays[0].dtype == np.int64,
    )
    return int(found[0]), int(found[1])


class GPTDataset:
    """Samples of ``seq_length + 1`` int64 tokens from ``documents`` of an IndexedDataset.

    ``len()`` is at least ``num_samples``: whole epochs are indexed, as in Megatron-LM.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: Optional[str] = None,
        name: str = "train",
    ):
        if num_samples < 1 or seq_length < 1:
            raise ValueError(f"{name}: need num_samples >= 1 and seq_length >= 1, got {num_samples}, {seq_length}")
        self.dataset, self.seq_length, self.name = indexed_dataset, seq_length, name
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) and (documents.min() < 0 or documents.max() >= len(indexed_dataset)):
            raise ValueError(f"{name}: document ids must lie in [0, {len(indexed_dataset)})")
        sizes = indexed_dataset.sequence_lengths
        if sizes[documents].sum(dtype=np.int64) == 0:
            raise ValueError(
                f"{name} split of {indexed_dataset.path_prefix}: its {len(documents)} documents hold no tokens"
            )
        description = {
            "class": "GPTDataset",
            "version": INDEX_VERSION,
            "num_samples": int(num_samples),
            "seq_length": int(seq_length),
            "seed": int(seed),
            "documents_md5": hashlib.md5(documents.tobytes(), usedforsecurity=False).hexdigest(),
            "sizes_md5": hashlib.md5(sizes[documents].tobytes(), usedforsecurity=False).hexdigest(),
        }

        def build():
            start = time.perf_counter()
            arrays = build_indices(sizes, documents, num_samples, seq_length, seed)
            logger.info(
                "%s: built indices of %d samples in %.2fs", name, len(arrays[1]) - 1, time.perf_counter() - start
            )
            return arrays

        stem = f"{os.path.basename(indexed_dataset.path_prefix)}-{name}"
        self.doc_idx, self.sample_idx, self.shuffle_idx = cached_arrays(
            cache_dir,
            stem,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            description,
            build,
            _indices_fit(len(indexed_dataset)),
        )

    def __len__(self) -> int:
        return len(self.sample_idx) - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name}: sample {idx} out of range [0, {len(self)})")
        i = int(self.shuffle_idx[idx])
        first, first_offset = (int(x) for x in self.sample_idx[i])
        last, last_offset = (int(x) for x in self.sample_idx[i + 1])
        get = self.dataset.get
        if first == last:
            parts = [get(int(self.doc_idx[first]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(self.doc_idx[first]), first_offset)]
            parts += [get(int(d)) for d in self.doc_idx[first + 1 : last]]
            parts.append(get(int(self.doc_idx[last]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)
