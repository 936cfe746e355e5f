"""Megatron-LM ``MMapIndexedDataset`` files (``PREFIX.bin`` + ``PREFIX.idx``), read and written.

The format is byte-for-byte Megatron-LM's, so corpora preprocessed by either project load in
the other. ``PREFIX.idx`` holds, little-endian::

    b"MMIDIDX\\x00\\x00"        9-byte magic
    <Q  version = 1
    <B  dtype code (see DTYPE_CODES)
    <Q  sequence count S
    <Q  document count D (= number of documents + 1)
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence byte offsets into PREFIX.bin
    int64[D]  document index: sequence i belongs to document j when doc[j] <= i < doc[j+1]

``PREFIX.bin`` is the tokens of every sequence back to back. Both files are memory-mapped;
nothing is unpickled.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-LM's DType codes; the numbering is part of the file format.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_FIXED_SIZE = len(HEADER) + 8 + 1 + 8 + 8


def best_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every token id fits (Megatron's rule: vocab < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def _format_error(path: str, what: str) -> ValueError:
    return ValueError(f"{path}: not a valid Megatron indexed dataset: {what}")


def _check_index(
    idx_path: str, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int
) -> None:
    """Sequences lie back to back (as every writer lays them out) and documents are ordered: a
    corrupted length or pointer would otherwise read other sequences' tokens without an error."""
    if len(lengths) and lengths.min() < 0:
        raise _format_error(idx_path, f"negative sequence length {int(lengths.min())}")
    expected = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected[1:])
    bad = np.flatnonzero(pointers != expected)
    if len(bad):
        i = int(bad[0])
        raise _format_error(
            idx_path,
            f"sequence {i} starts at byte {int(pointers[i])}, expected {int(expected[i])} "
            "(sequences must follow each other; corrupted index?)",
        )
    if len(documents) > 1 and np.any(np.diff(documents) < 0):
        raise _format_error(idx_path, "document index is not non-decreasing")


class IndexedDataset:
    """Random access to the token sequences of ``PREFIX.bin`` through ``PREFIX.idx``.

    A sequence is what Megatron calls one item; preprocess_data.py writes one sequence per
    document, so ``ds[i]`` is document i's tokens.
    """

    def __init__(self, prefix: str):
        self.path_prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        idx_size = os.path.getsize(idx_path)
        if idx_size < _FIXED_SIZE:
            raise _format_error(idx_path, f"{idx_size} bytes is shorter than the {_FIXED_SIZE}-byte header")
        with open(idx_path, "rb") as f:
            magic = f.read(len(HEADER))
            if magic != HEADER:
                raise _format_error(idx_path, f"header {magic!r}, expected {HEADER!r}")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != VERSION:
                raise _format_error(idx_path, f"version {version}, expected {VERSION}")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPE_CODES:
                raise _format_error(idx_path, f"dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
            (seq_count,) = struct.unpack("<Q", f.read(8))
            (doc_count,) = struct.unpack("<Q", f.read(8))
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _FIXED_SIZE + seq_count * (4 + 8) + doc_count * 8
        if idx_size != expected:
            raise _format_error(
                idx_path,
                f"{idx_size} bytes, expected {expected} for {seq_count} "
                f"sequences and {doc_count} document-index entries (truncated?)",
            )
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _FIXED_SIZE
        self.sequence_lengths = np.frombuffer(idx, np.int32, seq_count, offset)
        offset += seq_count * 4
        self.sequence_pointers = np.frombuffer(idx, np.int64, seq_count, offset)
        offset += seq_count * 8
        self.document_indices = np.frombuffer(idx, np.int64, doc_count, offset)
        if doc_count == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != seq_count:
            first_last = (self.document_indices[0], self.document_indices[-1]) if doc_count else "empty"
            raise _format_error(
                idx_path, f"document index must run from 0 to the sequence count {seq_count}, got {first_last}"
            )
        _check_index(
            idx_path, self.sequence_lengths, self.sequence_pointers, self.document_indices, self.dtype.itemsize
        )
        bin_size = os.path.getsize(bin_path)
        needed = 0
        if seq_count:
            needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if bin_size != needed:
            raise ValueError(
                f"{bin_path}: {bin_size} bytes, but {idx_path} describes {needed} bytes of "
                f"{self.dtype.name} tokens (the .bin and .idx do not belong together, or one is truncated)"
            )
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def token_range(self, chunk: int = 1 << 26) -> np.ndarray:
        """[smallest, largest] token id of the whole ``.bin`` (int64; [0, -1] when it holds none),
        in one streaming pass of ``chunk`` tokens at a time."""
        tokens = np.frombuffer(self._bin, self.dtype, len(self._bin) // self.dtype.itemsize)
        if not len(tokens):
            return np.array([0, -1], np.int64)
        lo, hi = tokens[0], tokens[0]
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            lo, hi = min(lo, part.min()), max(hi, part.max())
        return np.array([lo, hi], np.int64)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (a read-only view of the memory map)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} ({n} sequences)")
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) out of sequence {i} of length {size}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)


class IndexedDatasetBuilder:
    """Streams sequences into ``PREFIX.bin``; ``finalize`` writes ``PREFIX.idx``."""

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._document_indices = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence (without closing its document)."""
        array = np.asarray(tokens)
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids {array.min()}..{array.max()} do not fit in {self.dtype.name}")
        self._file.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(array.size)

    def end_document(self) -> None:
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        write_index(
            idx_path, self.dtype, np.asarray(self._lengths, np.int32), np.asarray(self._document_indices, np.int64)
        )


def write_index(idx_path: str, dtype, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a ``.idx`` for sequences of ``lengths`` stored back to back as ``dtype``."""
    dtype = np.dtype(dtype)
    pointers = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(np.asarray(lengths, np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(document_indices, np.int64).tobytes(order="C"))
