"""Does a checkpoint directory hold what its metadata.json says? Checked from the shard headers
alone (no tensor data is read), before a load or a conversion trusts the files, and after a
conversion, before its result is published; ``check_data`` reads every tensor against its
checksum (``inspect --verify``)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Optional

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.metadata import broadcast_statistics, kinds_of, metadata_config, metadata_table
from megatron_p2r.checkpoint.naming import METADATA_FILE, entry_name
from megatron_p2r.checkpoint.parts import StoredShards
from megatron_p2r.checkpoint.safetensors_io import ShardReader
from megatron_p2r.checkpoint.tensor_table import ShardLayout, file_entries
from megatron_p2r.optim.factored_form import FACTOR_KINDS


def check_recorded_size(reader: ShardReader, name: str, recorded: Optional[int]) -> None:
    """Fail unless shard ``name`` has the size metadata.json records for it."""
    if reader.size != recorded:
        raise CheckpointError(
            f"{reader.path}: {reader.size} bytes, but {METADATA_FILE} files[{name!r}] "
            f"records {recorded} (truncated or replaced?)"
        )


def check_files(iter_dir: str, meta: dict) -> StoredShards:
    """Every shard ``meta`` lists exists (whole or in parts), has its recorded size and holds
    exactly the expected tensors with the expected shapes, each once (headers only; no tensor
    data is read). Returns the shards, to read them."""
    cfg = metadata_config(meta)
    layout = ShardLayout.of(cfg)
    expected = file_entries(metadata_table(meta), layout, kinds_of(meta), broadcast_statistics(meta))
    readers = StoredShards(iter_dir, meta, expected)
    for name, entries in expected.items():
        for file, part in readers.physical(name):
            recorded = meta["files"].get(file)
            if recorded is None:
                raise CheckpointError(
                    f"{os.path.join(iter_dir, METADATA_FILE)}: files has no entry for {file}, "
                    f"which the layout {layout.to_json()} needs"
                )
            check_recorded_size(part, file, recorded)
            _check_checksums_cover(meta, file, part.names(), iter_dir)
        reader = readers(name)
        for entry, dtype, shape in entries:
            reader.check(entry, dtype, shape)
        extra = set(reader.names()) - {e[0] for e in entries}
        if extra:
            raise CheckpointError(
                f"{reader.path}: holds tensors {METADATA_FILE} does not list, e.g. {sorted(extra)[0]!r}"
            )
    return readers


def _check_checksums_cover(meta: dict, name: str, stored: list, iter_dir: str) -> None:
    """metadata.json's crc32 (when recorded: older checkpoints have none) has one value for each
    tensor stored in the file, so that no tensor escapes the check."""
    if meta.get("crc32") is None:
        return
    recorded, needed = set(meta["crc32"].get(name, {})), set(stored)
    if recorded != needed:
        odd = sorted(needed - recorded) or sorted(recorded - needed)
        raise CheckpointError(
            f"{os.path.join(iter_dir, METADATA_FILE)}: crc32[{name!r}] "
            f"{'has no value for' if needed - recorded else 'lists'} tensor {odd[0]!r}"
        )


def verify(iter_dir: str, meta: dict, expected_params: int) -> None:
    """Re-read every header: each needed tensor present exactly once, right shape, nothing extra;
    the parameter count (and each moment's element count) equals ``expected_params``."""
    readers = check_files(iter_dir, meta)  # exact per-file entry sets, shapes, sizes
    seen = Counter()
    totals = Counter()
    for name in layout_files(meta):
        for entry, e in readers(name).entries.items():
            seen[entry] += 1
            kind = entry.split(".")[1] if entry.startswith("optimizer.") else "model"
            n = 1
            for s in e["shape"]:
                n *= s
            totals[kind] += n
    table = metadata_table(meta)
    layout = ShardLayout.of(metadata_config(meta))
    for info in table.values():
        for kind in kinds_of(meta):
            name = entry_name(kind, info.key)
            if seen[name] != len(layout.tp_ranks_of(info)):
                raise CheckpointError(
                    f"{iter_dir}: {name!r} written {seen[name]} times, "
                    f"expected {len(layout.tp_ranks_of(info))} (one per TP shard)"
                )
    for kind in [k for k in kinds_of(meta) if k != "step" and k not in FACTOR_KINDS]:  # factored: by shape
        if totals[kind] != expected_params:
            raise CheckpointError(
                f"{iter_dir}: {kind} holds {totals[kind]:,} elements, the source implies "
                f"{expected_params:,}; refusing to publish an incomplete conversion"
            )


def layout_files(meta: dict) -> list:
    """The layout's shard files (each whole, or in the parts ``files`` lists)."""
    parts = meta.get("parts") or {}
    return [f for f in meta["files"] if not any(f in p for p in parts.values())] + list(parts)


def check_data(meta: dict, readers: StoredShards) -> int:
    """Read every tensor of every shard (and of every RNG file with checksums), one at a time,
    each checked against its CRC-32 when metadata.json records them; returns how many were read."""
    count = 0
    for name in list(meta["files"]) + [f for f in meta.get("crc32") or {} if f not in meta["files"]]:
        reader = readers.files(name)
        for entry in reader.names():
            reader.read(entry)
            count += 1
    return count
