"""Shards stored in parts: a fully parallel save (``parallel_save.py``) writes each logical shard
``mp_rank_TT_PPP_EEE`` as one part file per rank that owns some of it,
``mp_rank_TT_PPP_EEE.rank_RRRRR.safetensors``, and metadata.json's ``parts`` lists them.

A part holds *fragments* of the shard's entries: an entry it owns whole is stored under its own
name and shape, a flat range of one as ``<entry>@<offset>`` (1-D, ``offset`` in the entry's
flat elements). ``StoredShards`` opens a checkpoint's shards the same way whether they are
single files (single-writer saves, converters, older checkpoints) or parts, and
``PartedShard`` checks that the fragments tile every entry exactly once, so a piece written
twice or never is an error naming the part, not a silently wrong tensor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.naming import METADATA_FILE
from megatron_p2r.checkpoint.safetensors_io import TORCH_DTYPE, ReaderCache, ShardReader

OFFSET_MARK = "@"


def part_file(shard: str, rank: int) -> str:
    """The file rank ``rank`` writes its fragments of ``shard`` into."""
    return f"{shard.split('.')[0]}.rank_{rank:05d}.safetensors"


def fragment_name(entry: str, offset: int, whole: bool) -> str:
    return entry if whole else f"{entry}{OFFSET_MARK}{offset}"


@dataclasses.dataclass(frozen=True)
class Fragment:
    """Elements [offset, offset + numel) of an entry, stored as ``stored`` in ``reader``'s file."""

    reader: ShardReader
    stored: str
    offset: int
    numel: int


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PartedShard:
    """One logical shard stored in parts, read like a ``ShardReader``: ``entries``, ``check``,
    ``read`` (an entry assembled from its fragments) and ``fragments`` (to read only some)."""

    def __init__(self, name: str, parts: List[ShardReader], expected: Sequence[tuple]):
        self.name, self.parts = name, parts
        self.path = f"{name} (parts {', '.join(os.path.basename(r.path) for r in parts) or 'none'})"
        self.size = sum(r.size for r in parts)
        self.entries = {e: {"dtype": d, "shape": list(s)} for e, d, s in expected}
        self._fragments: Dict[str, List[Fragment]] = {e: [] for e in self.entries}
        for reader in parts:
            for stored, e in reader.entries.items():
                self._add(reader, stored, e)
        for entry, frags in self._fragments.items():
            self._check_tiling(entry, frags)

    def _add(self, reader: ShardReader, stored: str, e: dict) -> None:
        entry, mark, offset = stored.rpartition(OFFSET_MARK)
        if not mark:
            entry, offset = stored, "0"
        if entry not in self.entries or not (offset.isascii() and offset.isdigit()):  # int() refuses '²'
            raise CheckpointError(
                f"{reader.path}: holds tensor {stored!r}, which is no fragment of an entry "
                f"{METADATA_FILE} lists for {self.name}"
            )
        want = self.entries[entry]
        if (
            e["dtype"] != want["dtype"]
            or (not mark and list(e["shape"]) != want["shape"])
            or (mark and len(e["shape"]) != 1)
        ):
            raise CheckpointError(
                f"{reader.path}: fragment {stored!r} is {e['dtype']}{e['shape']}; the entry is "
                f"{want['dtype']}{want['shape']} (a fragment is the whole entry or flat)"
            )
        self._fragments[entry].append(Fragment(reader, stored, int(offset), _numel(e["shape"])))

    def _check_tiling(self, entry: str, frags: List[Fragment]) -> None:
        """The fragments of ``entry`` cover its elements exactly once (no gap, no overlap)."""
        frags.sort(key=lambda f: f.offset)
        cursor, total = 0, _numel(self.entries[entry]["shape"])
        for f in frags:
            if f.offset != cursor:
                what = "overlaps another fragment" if f.offset < cursor else f"leaves [{cursor}, {f.offset}) unwritten"
                raise CheckpointError(f"{f.reader.path}: fragment {f.stored!r} of {self.name} {what}")
            cursor += f.numel
        if cursor != total:
            raise CheckpointError(
                f"{self.path}: entry {entry!r} has {cursor} of its {total} elements "
                "(a rank's fragment is missing or too long)"
            )

    def names(self) -> List[str]:
        return list(self.entries)

    def check(self, name: str, dtype: str, shape: Sequence[int], field: str = "shape") -> None:
        entry = self.entries.get(name)
        if entry is None or entry["dtype"] != dtype or entry["shape"] != list(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is not stored as {dtype}{list(shape)} ({METADATA_FILE} {field})"
            )

    def fragments(self, name: str) -> List[Fragment]:
        return self._fragments[name]

    def read(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Entry ``name`` whole, each fragment read straight into its place."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        e = self.entries[name]
        if out is None:
            out = torch.empty(e["shape"], dtype=TORCH_DTYPE[e["dtype"]])
        flat = out.view(-1)
        for f in self._fragments[name]:
            part = flat[f.offset : f.offset + f.numel]
            f.reader.read(f.stored, out=part if f.stored != name else out)
        return out


class StoredShards:
    """A checkpoint's files by name: a logical shard (a ``ShardReader`` of its single file or a
    ``PartedShard``), or any physical file metadata.json lists (a part, an RNG file)."""

    def __init__(self, iter_dir: str, meta: dict, expected: Dict[str, Sequence[tuple]]):
        self.files = ReaderCache(iter_dir, meta.get("crc32"))
        self.parts: Dict[str, List[str]] = meta.get("parts") or {}
        self.expected = expected
        self._parted: Dict[str, PartedShard] = {}

    def __call__(self, name: str):
        if name not in self.parts:
            return self.files(name)
        if name not in self._parted:
            self._parted[name] = PartedShard(
                name, [self.files(p) for p in self.parts[name]], self.expected.get(name, ())
            )
        return self._parted[name]

    def physical(self, shard: str) -> List[Tuple[str, ShardReader]]:
        """(file name, reader) of every file holding ``shard``."""
        names = self.parts.get(shard, [shard])
        return [(n, self.files(n)) for n in names]
