"""Asynchronous save (``--async-save``, Megatron-LM's meaning): training stops only for each rank
to copy what it writes into host memory; a background thread writes the files while training
continues.

The publish (rank 0 writes metadata.json, renames ``iter_N.tmp`` into place and then
``latest``) needs every rank's files finished, which takes collectives — and collectives from a
second thread are unsafe with gloo and NCCL. So it runs on the training thread at the next
save, at the end of training and on an exit (``--exit-interval``, SIGTERM): ``finish_pending``
waits for this rank's writer, then every rank publishes together exactly as a synchronous save
does. Until then ``latest`` names the previous checkpoint, so a crash during the background
write (SIGKILL included) leaves that one loadable and ``recovery.py`` clears ``iter_N.tmp``.

The writes are those of the fully parallel save (``parallel_save.py``: every rank its own
fragments, into part files of its own), from the host copy; with one data-parallel rank too,
so no gather is ever needed. The host copy costs the rank's own share of the weights and
optimizer state, in the dtypes training holds them in (``planning/checkpoint_cost.py``:
``async_save_host_bytes``; with expert-DP 1 every rank owns its experts whole). It is one
snapshot of everything the rank writes, not a bounded stream: training updates the state in
place as soon as ``save_checkpoint`` returns, so what is not copied by then is lost to this save.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_p2r import reliability
from megatron_p2r.checkpoint import io
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.naming import LATEST_FILE
from megatron_p2r.optim.optimizer import OPTIMIZER_KINDS
from megatron_p2r.checkpoint.parallel_save import Fragment, owned_fragments, write_parts
from megatron_p2r.checkpoint.tensor_table import ShardLayout, tensor_table


@dataclasses.dataclass
class _Pending:
    """A save whose files a writer thread is writing; published by ``finish_pending``."""

    save_dir: str
    tmp: str
    final: str
    cfg: object
    progress: io.SavedProgress
    optimizer: bool
    thread: Optional[threading.Thread]
    error: List[BaseException] = dataclasses.field(default_factory=list)


_pending: Optional[_Pending] = None


def save_checkpoint(save_dir: str, state, wait: bool = False) -> str:
    """Collective: publish the previous asynchronous save, then save ``state`` — asynchronously
    with ``--async-save`` (returns once the host copy is taken; with ``wait``, once published)."""
    finish_pending(state.ps)
    if not state.cfg.checkpoint.async_save:
        return io.save_checkpoint(save_dir, state)
    global _pending
    tmp, final = io.prepare_save(save_dir, state)
    optimizer = io.has_optimizer_state(state)
    io.write_rng_file(tmp, state)
    host = host_copy(owned_state(state, optimizer))
    pending = _Pending(save_dir, tmp, final, state.cfg, io.SavedProgress.of(state), optimizer, None)
    pending.thread = threading.Thread(
        target=_write, args=(pending, host, state.ps.rank), name="p2r-async-save", daemon=True
    )
    pending.thread.start()
    _pending = pending
    if wait:
        finish_pending(state.ps)
    return final


def owned_state(state, optimizer: bool) -> List[Fragment]:
    """What this rank writes (its fragments of the weights and, with ``optimizer``, of the
    optimizer state), as views of its live state."""
    table, layout = tensor_table(state.cfg), ShardLayout.of(state.cfg)
    kinds = ("model",) + (OPTIMIZER_KINDS[state.cfg.train.optimizer] if optimizer else ())
    return owned_fragments(state, table, list(io.rank_pieces(state.model, state.ps, table)), layout, kinds)


def host_copy(fragments: List[Fragment]) -> List[Fragment]:
    """Each fragment copied into host memory (a clone on CPU: training updates the state in
    place), in its own dtype; the writer widens to fp32 one tensor at a time."""
    return [(name, stored, tensor.detach().to("cpu", copy=True)) for name, stored, tensor in fragments]


def _write(pending: _Pending, fragments: List[Fragment], rank: int) -> None:
    try:
        write_parts(pending.tmp, fragments)
    except BaseException as exc:  # reported on the training thread by finish_pending
        pending.error.append(exc)
        return
    reliability.save_point("shards", pending.progress.iteration, rank)  # while training goes on


def finish_pending(ps) -> None:
    """Collective: wait for this rank's writer and, once every rank's files are written,
    publish the pending checkpoint (nothing when none is pending)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    pending.thread.join()
    failed = torch.tensor([1.0 if pending.error else 0.0], device=ps.device)
    if ps.layout.world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        why = f": {pending.error[0]!r}" if pending.error else " on another rank"
        raise CheckpointError(
            f"asynchronous save of {pending.tmp} failed{why}; "
            f"{os.path.join(pending.save_dir, LATEST_FILE)} still names "
            "the previous checkpoint"
        )
    io.finish_save(pending.save_dir, pending.tmp, pending.final, pending.cfg, ps, pending.progress, pending.optimizer)
