"""Global pieces <-> their TP shards, streamed: read a piece whole from any layout's files, and
write a table's pieces into another layout's files, one piece in memory at a time.

Files are safetensors written by ``ShardWriter`` (headers first), so memory holds one piece at
a time: the peak is bounded by the largest tensor, not the model.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from megatron_p2r.checkpoint.naming import entry_name, shard_header_metadata
from megatron_p2r.checkpoint.parts import StoredShards
from megatron_p2r.checkpoint.safetensors_io import TORCH_DTYPE, ShardWriter, nbytes
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo, file_entries
from megatron_p2r.optim.factored_form import FACTOR_KINDS, entry_of, per_rank, split_dim

# (target piece, kind) -> the global tensor to store
Producer = Callable[[TensorInfo, str], torch.Tensor]


def read_global(
    readers: StoredShards, layout: ShardLayout, info: TensorInfo, kind: str, broadcast: bool = False
) -> torch.Tensor:
    """The whole piece's entry ``kind``: its TP shards read into one tensor (straight into place
    along dim 0). Adafactor's statistics: split along their own dimension, or each TP rank's own
    merged by their mean (``optim/factored_form.py``); from a ``broadcast`` checkpoint (before
    issue 37) each shard is factored first."""
    entry = entry_name(kind, info.key)
    if kind in FACTOR_KINDS:
        if broadcast and kind == "col_var" and len(info.shape) == 1 and info.expert is None:
            entry = entry_name("row_var", info.key)  # a vector's variance was its row_var, col_var ones
        shards = [readers(layout.file_of(info, t)).read(entry) for t in layout.tp_ranks_of(info)]
        if broadcast:
            local = layout.local_shape(info)
            shards = [entry_of(s, local, kind) for s in shards]
        if per_rank(len(info.shape), info.tp_dim, kind):
            return torch.stack(shards).mean(0)
        dim = split_dim(len(info.shape), info.tp_dim, kind)
        return shards[0] if dim is None else torch.cat(shards, dim)
    if kind == "step" or layout.tp_shards(info) == 1:
        return readers(layout.file_of(info, 0)).read(entry)
    out = torch.empty(info.shape, dtype=TORCH_DTYPE[info.dtype])
    for t, part in zip(layout.tp_ranks_of(info), out.chunk(layout.tp_shards(info), dim=info.tp_dim), strict=True):
        reader = readers(layout.file_of(info, t))
        if part.is_contiguous():
            reader.read(entry, out=part)
        else:
            part.copy_(reader.read(entry))
    return out


def tp_shards(tensor: torch.Tensor, info: TensorInfo, layout: ShardLayout, kind: str) -> List[Tuple[int, torch.Tensor]]:
    """(TP rank, its shard of the global ``tensor``) for every TP rank that stores the piece."""
    dim = split_dim(len(info.shape), info.tp_dim, kind) if kind in FACTOR_KINDS else info.tp_dim
    if kind == "step" or dim is None:
        return [(t, tensor) for t in layout.tp_ranks_of(info)]
    return list(zip(layout.tp_ranks_of(info), tensor.chunk(layout.tp_shards(info), dim=dim), strict=True))


def write_pieces(
    out_iter: str,
    table: Dict[str, TensorInfo],
    layout: ShardLayout,
    kinds: Sequence[str],
    produce: Producer,
    *,
    progress: bool,
    desc: str,
) -> Dict[str, Dict[str, int]]:
    """Write every piece of ``table`` (each of ``kinds``, as ``produce`` makes it) into ``layout``'s
    shard files under ``out_iter``: one global piece in memory at a time, the files of one stage
    open at a time (the table is in stage order). Returns each file's checksums (metadata.json's
    crc32)."""
    entries = file_entries(table, layout, kinds)
    total = sum(nbytes(dtype, shape) for ents in entries.values() for _, dtype, shape in ents)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=desc)
    writers: Dict[str, ShardWriter] = {}
    checksums: Dict[str, Dict[str, int]] = {}
    stage = -1
    for info in table.values():
        if info.stage != stage:
            _close_all(writers, checksums)
            stage = info.stage
            for name in layout.stage_files(stage):
                writers[name] = ShardWriter(os.path.join(out_iter, name), entries[name], shard_header_metadata(name))
        for kind in kinds:
            bar.update(_write_piece(writers, layout, info, kind, produce))
    _close_all(writers, checksums)
    # A stage can own no piece (a middle stage that only replays a pseudo slot of an earlier
    # stage); the layout still has its (empty) files.
    for name, ents in entries.items():
        if not os.path.exists(os.path.join(out_iter, name)):
            _close_all({name: ShardWriter(os.path.join(out_iter, name), ents, shard_header_metadata(name))}, checksums)
    bar.close()
    return checksums


def _write_piece(
    writers: Dict[str, ShardWriter], layout: ShardLayout, info: TensorInfo, kind: str, produce: Producer
) -> int:
    """Make one global tensor and append its TP shards; returns the bytes written.
    (A function of its own so that nothing of the piece outlives it.)"""
    tensor, written = produce(info, kind), 0
    for t, shard in tp_shards(tensor, info, layout, kind):
        writers[layout.file_of(info, t)].write(entry_name(kind, info.key), shard)
        written += shard.numel() * shard.element_size()
    return written


def _close_all(writers: Dict[str, ShardWriter], checksums: Dict[str, Dict[str, int]]) -> None:
    for name, w in writers.items():
        w.close()
        checksums[name] = w.checksums
    writers.clear()
