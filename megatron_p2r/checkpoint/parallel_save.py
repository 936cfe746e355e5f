"""Fully parallel save: every rank writes what it owns, from its own state, into part files of
its own (``parts.py``), so nothing is gathered and the writing is spread over all ranks.

What a rank owns of a piece (weights and AdamW state of one logical tensor's TP shard):
- under the distributed optimizer, the flat ranges its optimizer steps (``MainShard``s that
  count in the gradient norm: one member of a reduction group owns each element);
- otherwise, the whole piece when the piece's greedy byte-balanced assignment over the
  data-parallel (expert-data-parallel for experts) replicas names this rank
  (``layout.ownership.assign_writers``, which the planner reads too).

``owned_fragments`` lists (part file, fragment name, tensor) as views of the rank's state —
no copy, so the only extra memory while writing is the one tensor a writer stages (on the
device, or a 16-bit moment widened to fp32) — but for Adafactor's statistics, whose values
anchored at the owned elements (``optim/factored_form.py``) are small new tensors;
``write_parts`` writes such a list, so an asynchronous writer can run it on host copies.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_p2r.checkpoint.naming import entry_name, shard_header_metadata
from megatron_p2r.checkpoint.parts import fragment_name, part_file
from megatron_p2r.checkpoint.safetensors_io import ShardWriter
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo
from megatron_p2r.layout.ownership import WrittenPiece, assign_writers
from megatron_p2r.optim.factored_form import FACTOR_KINDS, anchored_range, entry_of, entry_shape
from megatron_p2r.optim.state_io import stored_state

CHECKSUMS_SUFFIX = ".crc32.json"  # a file's checksums, beside it until metadata.json holds them

# (part file, fragment name, tensor): what a rank writes
Fragment = Tuple[str, str, torch.Tensor]


def owned_fragments(
    state,
    table: Dict[str, TensorInfo],
    pieces: Iterable[Tuple[TensorInfo, torch.nn.Parameter, Optional[int]]],
    layout: ShardLayout,
    kinds: Sequence[str],
) -> List[Fragment]:
    """Everything this rank writes: its fragments of each piece in ``pieces`` (this rank's
    pieces, ``io.rank_pieces``), as views of its own optimizer state."""
    opt, ps, c = state.optimizer, state.ps, state.ps.coords
    written = [
        WrittenPiece(i.key, i.stage, layout.ep_rank_of(i), i.expert is not None, i.nbytes) for i in table.values()
    ]
    writers = assign_writers(written, ps.layout.dp_cp, ps.expert_dp_size)
    out: List[Fragment] = []
    for info, param, j in pieces:
        local = param[0].numel() if j is not None else param.numel()
        base = 0 if j is None else j * local
        for ms in opt.shards_of.get(id(param), []):
            lo, hi = max(ms.start, base), min(ms.end, base + local)
            if lo >= hi or not _owns(opt, ms, info, layout, c, writers):
                continue
            name = part_file(layout.file_of(info, c.tp), ps.rank)
            for kind in kinds:
                out.extend(_fragment(state, ms, info, layout, name, kind, (lo - base, hi - base), base))
    return out


def _owns(opt, ms, info: TensorInfo, layout: ShardLayout, c, writers: Dict[str, int]) -> bool:
    if opt.ddp.buffers[ms.buffer].layout.sharded:
        return ms.in_norm
    index = c.expert_dp if info.expert is not None else c.dp_cp
    return info.stage == c.pp and c.tp in layout.tp_ranks_of(info) and writers[info.key] == index


def _fragment(
    state, ms, info: TensorInfo, layout: ShardLayout, name: str, kind: str, span: Tuple[int, int], base: int
) -> List[Fragment]:
    """Elements ``span`` = [lo, hi) of the piece's ``kind`` (the step count once, with the first
    fragment); ``base``: where the piece starts in the parameter (expert j of a stacked one)."""
    lo, hi = span
    entry = entry_name(kind, info.key)
    if kind == "step":
        step = torch.tensor(float(state.optimizer.step_count), dtype=torch.float32).reshape(())
        return [(name, entry, step)] if lo == 0 else []
    value = stored_state(state.optimizer, ms, kind).reshape(-1)[lo + base - ms.start : hi + base - ms.start]
    shape = layout.local_shape(info)
    if kind in FACTOR_KINDS:  # the statistics' values anchored at these elements (optim/factored_form.py)
        value = entry_of(value, shape, kind, lo).reshape(-1)
        lo, shape = anchored_range(shape, kind, lo, hi)[0], entry_shape(shape, kind)
        if not value.numel():
            return []
    whole = lo == 0 and value.numel() == _numel(shape)
    return [(name, fragment_name(entry, lo, whole), value.view(shape) if whole else value)]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_parts(tmp: str, fragments: List[Fragment]) -> None:
    """Write ``fragments`` into their part files under ``tmp`` in fp32 (the checkpoint's dtype),
    one tensor staged (copied to host, widened from 16-bit moments) at a time, and leave each
    file's checksums beside it for the rank that writes metadata.json."""
    by_file: Dict[str, List[Tuple[str, torch.Tensor]]] = {}
    for name, stored, tensor in fragments:
        by_file.setdefault(name, []).append((stored, tensor))
    for name, items in by_file.items():
        writer = ShardWriter(
            os.path.join(tmp, name), [(s, "F32", tuple(t.shape)) for s, t in items], shard_header_metadata(name)
        )
        for stored, tensor in items:
            writer.write(stored, tensor.float())
        writer.close()
        leave_checksums(tmp, name, writer.checksums)


def leave_checksums(tmp: str, name: str, checksums: Dict[str, int]) -> None:
    """File ``name``'s checksums beside it, for rank 0 to put into metadata.json."""
    with open(os.path.join(tmp, name + CHECKSUMS_SUFFIX), "w", encoding="utf-8") as fh:
        json.dump(checksums, fh)
