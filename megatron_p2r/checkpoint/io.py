"""Save and resume distributed checkpoints (the format: ``naming.py``, ``tensor_table.py``,
``metadata.py``).

``save_checkpoint`` is collective: every rank writes its RNG file; with several data-parallel
ranks every rank writes what it owns of each shard into part files of its own
(``parallel_save.py``, ``parts.py``); otherwise, or with ``--no-ckpt-fully-parallel-save``, rank
(tp, pp, ep) with expert-dp rank 0 writes the shard ``mp_rank_TT_PPP_EEE`` whole with the pieces
it owns (see ``tensor_table.py``). Either way each element is written once. Everything goes to ``iter_N.tmp``;
after a barrier rank 0 writes ``metadata.json``, renames the directory and only then
replaces ``latest_checkpointed_iteration.txt``, so a run killed while saving leaves
``latest`` on the previous complete checkpoint (``recovery.py`` clears what it left).

``load_checkpoint`` checks the checkpoint against the run (format version, model shape,
P2R phase, parallel layout, every shard's header) and fails with a message naming the file
and the field, and the command to convert it when that is the fix.

Each writing rank leaves its shard's checksums (CRC-32 per tensor) beside it for rank 0 to put
into metadata.json; a load checks every tensor it reads against them (older checkpoints have
none and load unchecked).

Weights are stored in fp32 — the optimizer's main parameters, not a 16-bit rounding — and the
optimizer state whole per logical tensor (in fragments when written in parts): with the
distributed optimizer a single writer gathers each tensor's state from the ranks that step its
pieces (``optim/state_io.py``), and every rank keeps its own pieces on load, so a checkpoint does not depend on DP size, the distributed optimizer,
16-bit weights or offload.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p2r import reliability
from megatron_p2r.checkpoint.atomic import fsync_dir, write_text_atomic
from megatron_p2r.checkpoint.compatibility import check_compatible, check_tables
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.integrity import check_recorded_size
from megatron_p2r.checkpoint.metadata import (
    SELF_CHECKSUM,
    broadcast_statistics,
    build_metadata,
    checksum_coverage,
    kinds_of,
    metadata_table,
    read_metadata,
    write_metadata,
)
from megatron_p2r.checkpoint.naming import (
    LATEST_FILE,
    METADATA_FILE,
    RNG_DIR,
    complete_iterations,
    entry_name,
    iteration_dir_name,
    resolve_iteration_dir,
    rng_file,
    shard_file,
    shard_header_metadata,
)
from megatron_p2r.checkpoint.parallel_save import CHECKSUMS_SUFFIX, leave_checksums, owned_fragments, write_parts
from megatron_p2r.checkpoint.parts import PartedShard, StoredShards
from megatron_p2r.checkpoint.safetensors_io import ReaderCache, ShardWriter, save_tensors
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo, file_entries, tensor_table
from megatron_p2r.config import OPTIMIZERS
from megatron_p2r.files import read_json
from megatron_p2r.optim.factored_form import FACTOR_KINDS, carrier_of, entry_of
from megatron_p2r.optim.optimizer import OPTIMIZER_KINDS
from megatron_p2r.optim.state_io import MOMENTS, StateLoader, gather_state
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.sharding import expert_key, local_experts, logical_name
from megatron_p2r.parallel.state import Layout, ParallelState


def _barrier(ps: ParallelState) -> None:
    if ps.layout.world_size > 1:
        dist.barrier()


def rank_pieces(
    model: torch.nn.Module, ps: ParallelState, table: Dict[str, TensorInfo]
) -> Iterator[Tuple[TensorInfo, torch.nn.Parameter, Optional[int]]]:
    """(piece, parameter, local expert index or None) for every piece this rank holds a shard of."""
    for name, param in model.named_parameters():
        logical = logical_name(name, param)
        if getattr(param, "expert", False):
            for j, e in enumerate(local_experts(param, ps.ep_rank)):
                yield table[expert_key(logical, e)], param, j
        else:
            yield table[logical], param, None


# ----------------------------------------------------------------------------- save


def save_checkpoint(save_dir: str, state) -> str:
    """Collective save of ``state`` (a ``training.TrainState``); returns the iteration directory."""
    tmp, final = prepare_save(save_dir, state)
    table, layout = tensor_table(state.cfg), ShardLayout.of(state.cfg)
    optimizer = has_optimizer_state(state)
    write_rng_file(tmp, state)
    _write_shards(
        tmp, state, table, layout, ("model",) + (OPTIMIZER_KINDS[state.cfg.train.optimizer] if optimizer else ())
    )
    reliability.save_point("shards", state.iteration, state.ps.rank)
    finish_save(save_dir, tmp, final, state.cfg, state.ps, SavedProgress.of(state), optimizer)
    return final


@dataclasses.dataclass(frozen=True)
class SavedProgress:
    """What metadata.json records of the training progress, taken when the save starts (an
    asynchronous save publishes later, when training has moved on)."""

    iteration: int
    consumed_samples: int
    scheduler: dict
    scaler: dict

    @classmethod
    def of(cls, state) -> "SavedProgress":
        return cls(
            state.iteration,
            state.consumed_samples,
            copy.deepcopy(state.scheduler.state_dict()),
            copy.deepcopy(state.scaler.state_dict()),
        )


def prepare_save(save_dir: str, state) -> Tuple[str, str]:
    """Collective: the offloaded state made final and an empty ``iter_N.tmp``; returns (tmp, final)."""
    state.optimizer.finish_host_step()  # the offloaded layers' weights and moments are final
    final = os.path.join(save_dir, iteration_dir_name(state.iteration))
    tmp = final + ".tmp"
    if state.ps.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):  # left by a run killed while saving this iteration
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, RNG_DIR))
    _barrier(state.ps)
    state.ddp.finish_param_sync()
    return tmp, final


def finish_save(
    save_dir: str, tmp: str, final: str, cfg, ps: ParallelState, progress: SavedProgress, optimizer: bool
) -> None:
    """Collective, once every rank has written its files: rank 0 publishes the checkpoint."""
    _barrier(ps)
    if ps.rank == 0:
        _publish_checkpoint(save_dir, tmp, final, cfg, ps, progress, optimizer)
    _barrier(ps)


def has_optimizer_state(state) -> bool:
    """True once the optimizer has stepped (it has AdamW state), on every rank."""
    flag = torch.tensor([1.0 if state.optimizer.step_count else 0.0], device=state.ps.device)
    if state.ps.layout.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def write_rng_file(tmp: str, state) -> None:
    """This rank's RNG streams and data position (small: written synchronously by every save)."""
    ps, c = state.ps, state.ps.coords
    leave_checksums(
        tmp,
        rng_file(ps.rank),
        save_tensors(
            os.path.join(tmp, rng_file(ps.rank)),
            _rng_tensors(ps.device),
            {
                "rank": ps.rank,
                "tp": c.tp,
                "dp": c.dp,
                "pp": c.pp,
                "cp": c.cp,
                "consumed_samples": state.consumed_samples,
            },
        ),
    )


def _write_shards(tmp: str, state, table: Dict[str, TensorInfo], layout: ShardLayout, kinds: Sequence[str]) -> None:
    """What this rank writes of the shards: its own fragments (fully parallel save), or its whole
    shard when it is the one data-parallel replica that writes it."""
    pieces = list(rank_pieces(state.model, state.ps, table))
    if state.cfg.checkpoint.ckpt_fully_parallel_save and state.ps.layout.dp_cp > 1:  # one replica: one writer anyway
        write_parts(tmp, owned_fragments(state, table, pieces, layout, kinds))
    else:
        _write_whole_shard(tmp, state, table, layout, kinds, pieces)


def _write_whole_shard(
    tmp: str, state, table: Dict[str, TensorInfo], layout: ShardLayout, kinds: Sequence[str], pieces: list
) -> None:
    """One writer per shard (expert-dp rank 0), which gathers the distributed optimizer's state
    of its shard from the others (every rank takes part: a collective)."""
    ps, c = state.ps, state.ps.coords
    name = shard_file(c.tp, c.pp, c.ep)
    mine = {}
    for info, param, j in pieces:
        if c.expert_dp == 0 and info.stage == c.pp and layout.file_of(info, c.tp) == name:
            for kind in kinds:
                mine[entry_name(kind, info.key)] = (param, j, kind)
    written = {id(param) for param, _, _ in mine.values()}
    gathered = gather_state(state.optimizer, lambda p: id(p) in written)
    if c.expert_dp != 0:
        return
    entries = file_entries(table, layout, kinds)[name]
    writer = ShardWriter(os.path.join(tmp, name), entries, shard_header_metadata(name))
    for entry, _, _ in entries:
        if entry not in mine:
            raise CheckpointError(f"rank {ps.rank}: {name} needs {entry!r}, which this rank does not hold")
        param, j, kind = mine[entry]
        writer.write(entry, _piece_tensor(state, gathered[id(param)], j, kind))
    writer.close()
    leave_checksums(tmp, name, writer.checksums)


def _rng_tensors(device: torch.device) -> Dict[str, torch.Tensor]:
    out = {"cpu_rng_state": torch.get_rng_state(), "model_parallel_rng_state": tp_random.get_rng_tracker(device).state}
    if device.type == "cuda":
        out["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    return out


def _piece_tensor(state, gathered: Dict[str, torch.Tensor], j: Optional[int], kind: str) -> torch.Tensor:
    """One entry: the fp32 weight or a moment of a parameter (expert ``j`` of it), Adafactor's
    factored statistics of it, or the step count."""
    if kind == "step":
        return torch.tensor(float(state.optimizer.step_count), dtype=torch.float32).reshape(())
    t = gathered[kind] if j is None else gathered[kind][j]
    return entry_of(t, tuple(t.shape), kind) if kind in FACTOR_KINDS else t


def _publish_checkpoint(
    save_dir: str, tmp: str, final: str, cfg, ps: ParallelState, progress: SavedProgress, optimizer: bool
) -> None:
    """Rank 0, every shard written: metadata.json, rename into place, record as latest, prune."""
    iteration = progress.iteration
    table, layout = tensor_table(cfg), ShardLayout.of(cfg)
    reliability.save_point("metadata", iteration, ps.rank)
    kinds = OPTIMIZER_KINDS[cfg.train.optimizer] if optimizer else ()
    files, parts = _stored_files(tmp, table, layout, kinds)
    rng = {"world_size": ps.layout.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "cp": ps.cp_size}
    write_metadata(
        tmp,
        build_metadata(
            cfg,
            table,
            iteration=iteration,
            consumed_samples=progress.consumed_samples,
            optimizer=optimizer,
            optimizer_kinds=kinds,
            scheduler=progress.scheduler,
            scaler=progress.scaler,
            files=files,
            parts=parts,
            rng=rng,
            history=[],
            checksums=_collect_checksums(tmp, list(files) + [rng_file(r) for r in range(ps.layout.world_size)]),
        ),
    )
    fsync_dir(tmp)
    reliability.save_point("publish", iteration, ps.rank)
    _rename_into_place(tmp, final)
    reliability.save_point("latest", iteration, ps.rank)
    write_text_atomic(os.path.join(save_dir, LATEST_FILE), str(iteration))
    reliability.save_point("prune", iteration, ps.rank)
    if cfg.checkpoint.keep_last:
        _prune(save_dir, cfg.checkpoint.keep_last)


def _stored_files(
    tmp: str, table: Dict[str, TensorInfo], layout: ShardLayout, optimizer_kinds: Sequence[str]
) -> Tuple[Dict[str, int], Dict[str, List[str]]]:
    """Every shard file's size, and the part files of each shard written in parts — checked to
    hold each of its entries exactly once (headers only) before anything is published."""
    files, parts = {}, {}
    names = sorted(os.listdir(tmp))
    for shard in layout.files():
        if os.path.exists(os.path.join(tmp, shard)):
            files[shard] = os.path.getsize(os.path.join(tmp, shard))
            continue
        parts[shard] = [n for n in names if n.startswith(shard.split(".")[0] + ".rank_") and n.endswith(".safetensors")]
        files.update({n: os.path.getsize(os.path.join(tmp, n)) for n in parts[shard]})
    if parts:
        stored = StoredShards(tmp, {"parts": parts}, file_entries(table, layout, ("model",) + tuple(optimizer_kinds)))
        for shard in parts:
            stored(shard)
    return files, parts


def _collect_checksums(tmp: str, files: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """Each file's checksums (shards and RNG files), which its writer left beside it, for
    metadata.json (and the files that held them removed)."""
    out = {}
    for name in files:
        path = os.path.join(tmp, name + CHECKSUMS_SUFFIX)
        out[name] = read_json(path, CheckpointError)
        os.unlink(path)
    return out


def _rename_into_place(tmp: str, final: str) -> None:
    """Rename the finished directory into place (replacing a previous save of this iteration)."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")


def _prune(save_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints. Each is first renamed to
    ``iter_N.del`` so a kill mid-delete never leaves a half-deleted ``iter_N`` that looks loadable."""
    for iteration in complete_iterations(save_dir)[:-keep]:
        path = os.path.join(save_dir, iteration_dir_name(iteration))
        os.rename(path, path + ".del")
        shutil.rmtree(path + ".del")


# ----------------------------------------------------------------------------- load


def load_checkpoint(load_dir: str, state, finetune: bool = False) -> Optional[str]:
    """Restore ``state`` from ``load_dir``; with ``finetune`` only the weights. Returns the directory
    read, or None when ``--load`` is the ``--save`` directory and holds no checkpoint yet (the
    first launch of a job that always passes both)."""
    cfg, ps = state.cfg, state.ps
    state.optimizer.finish_host_step()  # no step of the old state writes into the loaded one
    ck = cfg.checkpoint
    if _first_launch(load_dir, ck.save):
        if ps.rank == 0:
            print(
                f"no checkpoint in {load_dir} yet (--load is the --save directory); starting from scratch", flush=True
            )
        return None
    iter_dir = resolve_iteration_dir(load_dir)
    meta = read_metadata(iter_dir)
    if ps.rank == 0 and SELF_CHECKSUM not in meta:
        print(f"{iter_dir}: {checksum_coverage(meta)}", flush=True)
    check_compatible(meta, cfg, iter_dir, load_dir)
    table = metadata_table(meta)
    check_tables(table, tensor_table(cfg), os.path.join(iter_dir, METADATA_FILE))
    load_optim = meta["optimizer"] and not finetune and not ck.no_load_optim
    kinds = state_kinds_to_load(meta, cfg.train.optimizer, os.path.join(iter_dir, METADATA_FILE)) if load_optim else ()
    from_adam = load_optim and kinds != OPTIMIZER_KINDS[cfg.train.optimizer]  # AdamW's state into Adafactor
    loader = StateLoader(
        state.optimizer,
        meta["config"]["train"].get("adam_beta2", 0.999) if from_adam else None,
        "row_var" if broadcast_statistics(meta) else "col_var",
    )
    _load_pieces(iter_dir, meta, table, state, ("model",) + kinds, loader)
    loader.finish(moments=load_optim)
    if not finetune:
        _load_progress(iter_dir, meta, state)
        if not ck.no_load_rng:
            _on_every_rank(lambda: _load_rng(iter_dir, meta, ps))
    if ps.rank == 0:
        what = "weights only" if finetune else ("without optimizer state" if not load_optim else "full state")
        print(
            f"loaded checkpoint {iter_dir} (iteration {meta['iteration']}, consumed samples "
            f"{meta['consumed_samples']}; {what})",
            flush=True,
        )
    return iter_dir


def state_kinds_to_load(meta: dict, optimizer: str, where: str) -> Tuple[str, ...]:
    """The optimizer state entries to read for ``--optimizer``: its own; from AdamW's state, those
    its spec's ``from_adam`` names (config/optimizers.py: Lion's one moment is AdamW's first,
    Adafactor makes its statistics of the second, ``optim/state_io.py``); anything else is
    refused by name."""
    stored = kinds_of(meta)[1:]
    wanted = OPTIMIZER_KINDS[optimizer]
    if all(k in stored for k in wanted):
        return wanted
    from_adam = OPTIMIZERS[optimizer].from_adam
    if from_adam is not None and stored == OPTIMIZER_KINDS["adam"]:
        return from_adam
    saved = next((name for name, kinds in OPTIMIZER_KINDS.items() if tuple(kinds) == tuple(stored)), "another")
    missing = [k for k in wanted if k not in stored]
    raise CheckpointError(
        f"{where}: the checkpoint holds {saved} optimizer state ({', '.join(stored)}); "
        f"--optimizer {optimizer} needs {', '.join(missing)}. Train on with --optimizer "
        f"{saved}, or pass --no-load-optim to load the weights and start {optimizer}'s "
        "state afresh"
    )


def _first_launch(load_dir: str, save_dir: Optional[str]) -> bool:
    """``--load`` is the ``--save`` directory and nothing was saved there yet."""
    return bool(
        save_dir
        and os.path.realpath(save_dir) == os.path.realpath(load_dir)
        and not os.path.exists(os.path.join(load_dir, LATEST_FILE))
    )


def _load_pieces(
    iter_dir: str, meta: dict, table: Dict[str, TensorInfo], state, kinds: Sequence[str], loader: StateLoader
) -> None:
    """Hand this rank's shard of every piece (each of ``kinds``) to ``loader``: the weights go
    into the model and the optimizer's mains, the moments into the optimizer's pieces."""
    ps, broadcast = state.ps, broadcast_statistics(meta)
    layout = ShardLayout.of(state.cfg)
    readers = StoredShards(iter_dir, meta, file_entries(table, layout, kinds_of(meta), broadcast))
    checked = set()
    with torch.no_grad():
        for info, param, j in rank_pieces(state.model, ps, table):
            name = layout.file_of(info, ps.tp_rank)
            if name not in checked:
                for file, reader in readers.physical(name):
                    check_recorded_size(reader, file, meta["files"].get(file))
                checked.add(name)
            reader = readers(name)
            local = layout.local_shape(info)
            for kind in kinds:
                entry = entry_name(kind, info.key)
                reader.check(entry, "F32" if kind == "step" else info.dtype, layout.entry_shape(info, kind, broadcast))
                offset = 0 if j is None else j * param[0].numel()  # expert j of a stacked parameter
                if (
                    kind in MOMENTS
                    and not loader.reads_whole(kind)
                    and state.cfg.checkpoint.ckpt_fully_parallel_load
                    and isinstance(reader, PartedShard)
                ):
                    _load_owned_fragments(reader, entry, param, offset, kind, loader)
                elif kind in FACTOR_KINDS and not broadcast:  # the loader takes them broadcast
                    loader.put(param, offset, kind, carrier_of(reader.read(entry), local, kind))
                else:
                    loader.put(param, offset, kind, reader.read(entry))


def _load_owned_fragments(
    reader: PartedShard, entry: str, param: torch.nn.Parameter, offset: int, kind: str, loader: StateLoader
) -> None:
    """Read only the fragments of a moment that overlap what this rank's optimizer steps."""
    for f in reader.fragments(entry):
        if loader.steps_any(param, offset + f.offset, f.numel):
            loader.put(param, offset + f.offset, kind, f.reader.read(f.stored))


def _load_progress(iter_dir: str, meta: dict, state) -> None:
    """Iteration, consumed samples, LR schedule and loss scaler."""
    state.iteration, state.consumed_samples = int(meta["iteration"]), int(meta["consumed_samples"])
    try:
        state.scheduler.load_state_dict(meta["scheduler"])
        state.scaler.load_state_dict(meta["scaler"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{os.path.join(iter_dir, METADATA_FILE)}: fields 'scheduler'/'scaler' are malformed ({exc!r})"
        ) from None


def _on_every_rank(load) -> None:
    """Run this rank's part of a load (a file of its own); when it fails on any rank, every rank
    raises the first failing rank's error, which names its file: rank 0's log, the one read first,
    said only that a peer had died."""
    failure = None
    try:
        load()
    except CheckpointError as exc:
        failure = str(exc)
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    rank, message = next(((r, m) for r, m in enumerate(failures) if m is not None), (None, None))
    if message is not None:
        raise CheckpointError(message if failure == message else f"rank {rank}: {message}")


def _load_rng(iter_dir: str, meta: dict, ps: ParallelState) -> None:
    """Restore this rank's RNG streams. They are seeded by (tp, pp, cp) only, so with a different DP
    the state of data-parallel rank 0 at the same (tp, pp, cp) is the right one; with a different CP
    size, that of CP rank 0 (a CP rank's dropout masks differ from the one-process run's anyway)."""
    info = meta.get("rng")
    if not info:
        if ps.rank == 0:
            print(f"{iter_dir}: no RNG states (converted checkpoint); continuing with this run's seeds", flush=True)
        return
    saved = Layout(tp=info["tp"], pp=info["pp"], dp=info["dp"], cp=info.get("cp", 1))
    c = ps.coords
    same_cp = saved.cp == ps.cp_size
    rank = saved.rank(c.tp, c.dp if saved.dp == ps.dp_size and same_cp else 0, c.pp, c.cp if same_cp else 0)
    reader = ReaderCache(iter_dir, meta.get("crc32"))(rng_file(rank))
    torch.set_rng_state(reader.read("cpu_rng_state").clone())
    tp_random.get_rng_tracker(ps.device).state = reader.read("model_parallel_rng_state").clone()
    if ps.device.type == "cuda":
        if "cuda_rng_state" not in reader.entries:
            raise CheckpointError(
                f"{reader.path}: no cuda_rng_state (saved on CPU); pass --no-load-rng to resume on CUDA"
            )
        torch.cuda.set_rng_state(reader.read("cuda_rng_state"), ps.device)
