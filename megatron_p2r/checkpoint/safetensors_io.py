"""Streaming safetensors files: write one tensor at a time, read exactly the bytes of one tensor.

Shards are real safetensors files (any safetensors reader opens them), but the header of a
file is known before its tensors are, so a converter writes one tensor at a time and reads
exactly the bytes of the tensor it needs. Nothing is ever unpickled.

Every tensor written gets a CRC-32 of its bytes (``ShardWriter.checksums``; safetensors has no
checksum of its own), which metadata.json records and ``ShardReader.read`` checks against the
bytes it reads anyway, so a flipped bit in a data region is an error naming the file and the
tensor rather than a silently different weight.

Every file is checked by the ``safetensors`` library itself before its header is trusted
(bounded header, unique names, offsets that tile the data region exactly, with no overlap or
gap), so this reader accepts exactly the files the official one does: a duplicated or
overlapping entry would otherwise read another tensor's bytes back.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Dict, Iterable, List, Optional, Sequence

import safetensors
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.naming import METADATA_FILE
from megatron_p2r.files import check_regular, confined, open_regular

# torch dtype -> safetensors dtype string, and back
SAFETENSORS_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPE = {v: k for k, v in SAFETENSORS_DTYPE.items()}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit


def nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Size of a tensor of safetensors ``dtype`` and ``shape``."""
    n = torch.empty((), dtype=TORCH_DTYPE[dtype]).element_size()
    for s in shape:
        n *= s
    return n


class SourceVanished(OSError):
    """A file whose checkpoint was complete when reading began is gone (deleted or renamed
    meanwhile): the input was good, so this is a failed run (exit 1), not bad input."""

    def __init__(self, path: str):
        super().__init__(
            f"{path} disappeared while it was being read: it was deleted or renamed meanwhile (a "
            "training run pruning that checkpoint with --keep-last?); read one it keeps"
        )


def _gone(path: str) -> bool:
    """The directory of ``path`` is gone too: the checkpoint it was listed in went away."""
    return not os.path.isdir(os.path.dirname(path) or ".")


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in the order its header announces.

    The header (names, dtypes, shapes, offsets) is written first, so memory never holds more
    than the tensor being written; ``close`` fails if any announced tensor is missing.
    ``checksums`` maps each tensor written to the CRC-32 of its bytes.
    """

    def __init__(self, path: str, entries: Sequence[tuple], metadata: Optional[Dict[str, str]] = None):
        self.path, self.entries, self.next = path, list(entries), 0
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name, dtype, shape in self.entries:
            size = nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(blob)) + blob)
        self.bytes_written = 0
        self.checksums: Dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.entries):
            raise CheckpointError(f"{self.path}: tensor {name!r} is not announced in the header")
        want, dtype, shape = self.entries[self.next]
        if name != want or SAFETENSORS_DTYPE[tensor.dtype] != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: expected tensor {want!r} {dtype}{list(shape)} next, "
                f"got {name!r} {SAFETENSORS_DTYPE.get(tensor.dtype)}{list(tensor.shape)}"
            )
        data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        self.checksums[name] = zlib.crc32(data)
        self.fh.write(data)
        self.bytes_written += data.nbytes
        self.next += 1

    def close(self) -> None:
        missing = [e[0] for e in self.entries[self.next :]]
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if missing:
            raise CheckpointError(
                f"{self.path}: {len(missing)} announced tensors were never written, first {missing[0]!r}"
            )


def save_tensors(
    path: str, tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None
) -> Dict[str, int]:
    """A whole small dict (RNG states) as one safetensors file; returns its checksums."""
    writer = ShardWriter(path, [(k, SAFETENSORS_DTYPE[v.dtype], tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    return writer.checksums


class ShardReader:
    """The header of one safetensors file, validated by the safetensors library; reads single
    tensors, each checked against its CRC-32 in ``checksums`` (entry -> CRC) when given."""

    def __init__(self, path: str, checksums: Optional[Dict[str, int]] = None):
        self.path, self.checksums = path, checksums
        try:
            self.size = check_regular(path, CheckpointError, "shard")
        except FileNotFoundError:
            raise (SourceVanished(path) if _gone(path) else CheckpointError(f"missing shard {path}")) from None
        n, header = _read_header(path, self.size)
        self.metadata = header.pop("__metadata__", {}) or {}
        for name, e in header.items():
            _check_entry(path, name, e)
        self.data_start = 8 + n
        self.entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > self.size:
            raise CheckpointError(
                f"truncated shard {path}: its tensors need {self.data_start + end} bytes, the file has {self.size}"
            )
        _check_with_library(path)

    def names(self) -> List[str]:
        return list(self.entries)

    def check(self, name: str, dtype: str, shape: Sequence[int], field: str = "shape") -> None:
        """Fail, naming file and tensor, unless ``name`` is stored with ``dtype`` and ``shape``."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} listed in {METADATA_FILE} is not in the shard")
        if entry["dtype"] != dtype:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, {METADATA_FILE} says {dtype}"
            )
        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(entry['shape'])}, expected "
                f"{list(shape)} from {METADATA_FILE} ({field})"
            )

    def read(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``name``, read straight into ``out`` (a contiguous CPU tensor of its shape) if given."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        start, end = entry["data_offsets"]
        dtype, shape = TORCH_DTYPE[entry["dtype"]], tuple(entry["shape"])
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {entry['dtype']}{list(shape)}, cannot read it "
                f"into {out.dtype}{list(out.shape)}"
            )
        try:
            fh = open_regular(self.path, CheckpointError, "shard")
        except FileNotFoundError:
            raise SourceVanished(self.path) from None  # its header was read: it was there
        with fh:
            fh.seek(self.data_start + start)
            data = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            if end > start and fh.readinto(data) != end - start:
                raise CheckpointError(f"truncated shard {self.path}: tensor {name!r} is cut short")
        if self.checksums is not None:
            self._check_sum(name, data)
        return out

    def _check_sum(self, name: str, data: memoryview) -> None:
        expected, found = self.checksums.get(name), zlib.crc32(data)
        if expected is None:
            raise CheckpointError(f"{self.path}: {METADATA_FILE} records no checksum for tensor {name!r}")
        if found != expected:
            raise CheckpointError(
                f"corrupt shard {self.path}: tensor {name!r} has CRC-32 {found:08x}, "
                f"{METADATA_FILE} records {expected:08x} (its bytes changed after it was written: "
                "a bad disk, memory or copy); restore the file from a good copy"
            )


def _read_header(path: str, size: int) -> tuple:
    """(header length, header) of a file the safetensors library accepts; an error naming the
    file otherwise. The header is read only when its announced length is plausible."""
    try:
        fh = open_regular(path, CheckpointError, "shard")
    except FileNotFoundError:
        raise (SourceVanished(path) if _gone(path) else CheckpointError(f"missing shard {path}")) from None
    with fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"truncated shard {path}: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"truncated shard {path}: header of {n} bytes announced, file has {size} bytes"
                if n <= _MAX_HEADER
                else f"corrupt shard {path}: header of {n} bytes announced (safetensors allows {_MAX_HEADER})"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"corrupt shard {path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt shard {path}: header is a JSON {type(header).__name__}, not an object")
    return n, header


def _check_with_library(path: str) -> None:
    """Let the safetensors library validate the whole layout of ``path`` (it maps, never reads, the data)."""
    try:
        with safetensors.safe_open(path, framework="pt"):
            pass
    except Exception as exc:  # SafetensorError, its only exception type, is not exported by every version
        if not os.path.exists(path):
            raise SourceVanished(path) from None
        raise CheckpointError(
            f"corrupt shard {path}: the safetensors library refuses it ({str(exc).splitlines()[0][:200]})"
        ) from None


def _check_entry(path: str, name: str, e) -> None:
    """One header entry is a known dtype, a shape, and offsets spanning exactly its bytes."""
    ok = (
        isinstance(e, dict)
        and isinstance(e.get("dtype"), str)
        and e["dtype"] in TORCH_DTYPE
        and isinstance(e.get("shape"), list)
        and all(isinstance(s, int) and s >= 0 for s in e["shape"])
        and isinstance(e.get("data_offsets"), list)
        and len(e["data_offsets"]) == 2
        and all(isinstance(o, int) for o in e["data_offsets"])
    )
    if (
        not ok
        or not 0 <= e["data_offsets"][0] <= e["data_offsets"][1]
        or e["data_offsets"][1] - e["data_offsets"][0] != nbytes(e["dtype"], e["shape"])
    ):
        raise CheckpointError(
            f"corrupt shard {path}: header entry {name!r} is not a valid tensor "
            f"(dtype, shape, data_offsets): {json.dumps(e)[:120]}"
        )


class ReaderCache:
    """Parsed headers by path (a converter touches each file many times); with ``checksums``
    (file name -> entry -> CRC-32, metadata.json's ``crc32``) every tensor read is checked."""

    def __init__(self, root: str, checksums: Optional[Dict[str, Dict[str, int]]] = None):
        self.root, self._readers, self.checksums = root, {}, checksums

    def __call__(self, name: str) -> ShardReader:
        """The reader of file ``name`` (a name read from metadata.json or an index: confined to the root)."""
        if name not in self._readers:
            sums = None if self.checksums is None else self.checksums.get(name, {})
            self._readers[name] = ShardReader(confined(self.root, name, CheckpointError, "file name"), sums)
        return self._readers[name]
