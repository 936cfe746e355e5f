"""Save and resume distributed checkpoints (the format is in ``format.py``).

``save_checkpoint`` is collective: every rank writes its RNG file; rank (tp, pp, ep) with
expert-dp rank 0 writes the shard ``mp_rank_TT_PPP_EEE`` with the pieces it owns (see
``format.py``), so data-parallel replicas write once. Everything goes to ``iter_N.tmp``;
after a barrier rank 0 writes ``metadata.json``, renames the directory and only then
replaces ``latest_checkpointed_iteration.txt``, so a run killed while saving leaves
``latest`` on the previous complete checkpoint.

``load_checkpoint`` checks the checkpoint against the run (format version, model shape,
P2R phase, parallel layout, every shard's header) and fails with a message naming the file
and the field, and the command to convert it when that is the fix.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.checkpoint.format import (
    FORMAT_VERSION, LATEST_FILE, OPTIM_KINDS, RNG_DIR, CheckpointError, ReaderCache, ShardLayout, ShardReader,
    ShardWriter, TensorInfo, entry_name, file_entries, fsync_dir, iteration_dir_name, metadata_config,
    metadata_table, read_metadata, resolve_iteration_dir, rng_file, save_tensors, shard_file,
    shard_header_metadata, tensor_table, write_metadata, write_text_atomic)
from megatron_p2r import reliability
from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.sharding import expert_key, local_experts, logical_name
from megatron_p2r.parallel.state import Layout, ParallelState

_ITER_DIR = re.compile(r"^iter_(\d{7})$")


# ----------------------------------------------------------------------------- helpers

def _barrier(ps: ParallelState) -> None:
    if ps.layout.world_size > 1:
        dist.barrier()


def rank_pieces(model: torch.nn.Module, ps: ParallelState,
                table: Dict[str, TensorInfo]) -> Iterator[Tuple[TensorInfo, torch.nn.Parameter, Optional[int]]]:
    """(piece, parameter, local expert index or None) for every piece this rank holds a shard of."""
    for name, param in model.named_parameters():
        logical = logical_name(name, param)
        if getattr(param, "expert", False):
            for j, e in enumerate(local_experts(param, ps.ep_rank)):
                yield table[expert_key(logical, e)], param, j
        else:
            yield table[logical], param, None


def _p2r_json(cfg: Config) -> dict:
    plan = ParallelPlan.model_parallel(cfg)
    return {"phase": plan.phase, "share_pattern": plan.share_pattern, "layer_module_keys": list(plan.layer_keys)}


def build_metadata(cfg: Config, table: Dict[str, TensorInfo], *, iteration: int, consumed_samples: int,
                   optimizer: bool, scheduler: dict, scaler: dict, files: Dict[str, int],
                   rng: Optional[dict], history: List[dict]) -> dict:
    """The metadata.json contents (shared by training saves and the converter)."""
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "config": cfg.to_dict(), "layout": ShardLayout.of(cfg).to_json(), "p2r": _p2r_json(cfg),
            "optimizer": optimizer, "optimizer_kinds": list(OPTIM_KINDS) if optimizer else [],
            "scheduler": scheduler, "scaler": scaler, "rng": rng, "history": history,
            "files": files, "tensors": {k: v.to_json() for k, v in table.items()}}


# ----------------------------------------------------------------------------- save

def _has_optimizer_state(state) -> bool:
    """True when every parameter has AdamW state (False before the first step), on every rank."""
    params = state.params
    have = sum(1 for p in params if all(k in state.optimizer.state.get(p, {}) for k in OPTIM_KINDS))
    if 0 < have < len(params):
        raise CheckpointError(f"rank {state.ps.rank}: {have} of {len(params)} parameters have optimizer state; "
                              "a checkpoint needs all or none")
    flag = torch.tensor([1.0 if have else 0.0], device=state.ps.device)
    if state.ps.layout.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _piece_tensor(state, param, j: Optional[int], kind: str) -> torch.Tensor:
    if kind == "model":
        t = param.detach()
    elif kind == "step":
        return torch.as_tensor(state.optimizer.state[param]["step"], dtype=torch.float32).reshape(())
    else:
        t = state.optimizer.state[param][kind]
    return t if j is None else t[j]


def _rng_tensors(device: torch.device) -> Dict[str, torch.Tensor]:
    out = {"cpu_rng_state": torch.get_rng_state(),
           "model_parallel_rng_state": tp_random.get_rng_tracker(device).state}
    if device.type == "cuda":
        out["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    return out


def save_checkpoint(save_dir: str, state) -> str:
    """Collective save of ``state`` (a ``training.TrainState``); returns the iteration directory."""
    cfg, ps = state.cfg, state.ps
    final = os.path.join(save_dir, iteration_dir_name(state.iteration))
    tmp = final + ".tmp"
    if ps.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):  # left by a run killed while saving this iteration
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, RNG_DIR))
    _barrier(ps)
    table = tensor_table(cfg)
    layout = ShardLayout.of(cfg)
    optimizer = _has_optimizer_state(state)
    kinds = ("model",) + (OPTIM_KINDS if optimizer else ())
    c = ps.coords
    save_tensors(os.path.join(tmp, rng_file(ps.rank)), _rng_tensors(ps.device),
                 {"rank": ps.rank, "tp": c.tp, "dp": c.dp, "pp": c.pp, "consumed_samples": state.consumed_samples})
    if c.expert_dp == 0:
        name = shard_file(c.tp, c.pp, c.ep)
        mine = {}
        for info, param, j in rank_pieces(state.model, ps, table):
            if info.stage == c.pp and layout.file_of(info, c.tp) == name:
                for kind in kinds:
                    mine[entry_name(kind, info.key)] = (param, j, kind)
        entries = file_entries(table, layout, kinds)[name]
        writer = ShardWriter(os.path.join(tmp, name), entries, shard_header_metadata(name))
        for entry, _, _ in entries:
            if entry not in mine:
                raise CheckpointError(f"rank {ps.rank}: {name} needs {entry!r}, which this rank does not hold")
            param, j, kind = mine[entry]
            writer.write(entry, _piece_tensor(state, param, j, kind))
        writer.close()
    reliability.save_point("shards", state.iteration, ps.rank)
    _barrier(ps)
    if ps.rank == 0:
        reliability.save_point("metadata", state.iteration, ps.rank)
        files = {f: os.path.getsize(os.path.join(tmp, f)) for f in layout.files()}
        rng = {"world_size": ps.layout.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size}
        write_metadata(tmp, build_metadata(cfg, table, iteration=state.iteration,
                                           consumed_samples=state.consumed_samples, optimizer=optimizer,
                                           scheduler=state.scheduler.state_dict(), scaler=state.scaler.state_dict(),
                                           files=files, rng=rng, history=[]))
        fsync_dir(tmp)
        reliability.save_point("publish", state.iteration, ps.rank)
        _publish(tmp, final)
        reliability.save_point("latest", state.iteration, ps.rank)
        write_text_atomic(os.path.join(save_dir, LATEST_FILE), str(state.iteration))
        reliability.save_point("prune", state.iteration, ps.rank)
        if cfg.checkpoint.keep_last:
            _prune(save_dir, cfg.checkpoint.keep_last)
    _barrier(ps)
    return final


def _publish(tmp: str, final: str) -> None:
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
    done = sorted(int(m.group(1)) for d in os.listdir(save_dir) if (m := _ITER_DIR.match(d))
                  and os.path.isfile(os.path.join(save_dir, d, "metadata.json")))
    for iteration in done[:-keep]:
        path = os.path.join(save_dir, iteration_dir_name(iteration))
        os.rename(path, path + ".del")
        shutil.rmtree(path + ".del")


# ----------------------------------------------------------------------------- compatibility

# Model fields that decide tensor shapes: (name shown, flag, value getter).
_STRUCTURE = [
    ("num_layers", "--num-layers", lambda m: m.num_layers),
    ("hidden_size", "--hidden-size", lambda m: m.hidden_size),
    ("ffn_hidden_size", "--ffn-hidden-size", lambda m: m.ffn_size),
    ("num_attention_heads", "--num-attention-heads", lambda m: m.num_attention_heads),
    ("padded_vocab_size", "--vocab-size/--make-vocab-size-divisible-by", lambda m: m.padded_vocab_size),
    ("normalization", "--normalization", lambda m: m.normalization),
    ("swiglu", "--swiglu", lambda m: m.swiglu),
    ("position_embedding_type", "--position-embedding-type", lambda m: m.position_embedding_type),
    ("max_position_embeddings", "--max-position-embeddings",
     lambda m: m.max_positions if m.position_embedding_type == "learned_absolute" else None),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights",
     lambda m: m.untie_embeddings_and_output_weights),
    ("disable_bias_linear", "--disable-bias-linear", lambda m: m.disable_bias_linear),
    ("num_experts", "--num-experts", lambda m: m.num_experts),
    ("moe_layer_freq", "--moe-layer-freq", lambda m: m.moe_layer_freq if m.num_experts else None),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", lambda m: m.expert_ffn_size if m.num_experts else None),
    ("moe_num_prototypes", "--moe-num-prototypes", lambda m: m.moe_num_prototypes if m.num_experts else None),
]


def target_flags(layout: ShardLayout) -> str:
    """The converter flags that produce ``layout``."""
    counts = [b - a for a, b in layout.stage_layers]
    flags = f"--target-tensor-parallel-size {layout.tp} --target-pipeline-parallel-size {layout.pp}"
    if len(set(counts)) > 1:
        flags += f" --target-pipeline-layer-split {','.join(map(str, counts))}"
    return flags + f" --target-expert-parallel-size {layout.ep}"


def _describe(layout: ShardLayout) -> str:
    return (f"TP={layout.tp}, PP={layout.pp} (layers per stage "
            f"{[b - a for a, b in layout.stage_layers]}), EP={layout.ep}")


def check_compatible(meta: dict, cfg: Config, iter_dir: str, load_dir: str) -> None:
    """Fail unless the checkpoint's model, phase and layout are the run's."""
    where = os.path.join(iter_dir, "metadata.json")
    saved = metadata_config(meta)
    for name, flag, get in _STRUCTURE:
        a, b = get(saved.model), get(cfg.model)
        if a != b:
            raise CheckpointError(f"{where}: the checkpoint's model has {name} = {a!r}, this run has {b!r} "
                                  f"({flag}); the model shape must match to load")
    phase, run_phase = meta["p2r"]["phase"], cfg.p2r.p2r_phase
    run_layout, saved_layout = ShardLayout.of(cfg), ShardLayout.of(saved)
    if phase == "pseudo" and run_phase == "real":
        raise CheckpointError(f"{where}: p2r.phase is 'pseudo' (share pattern {meta['p2r']['share_pattern']}), "
                              f"this run is --p2r-phase real. Delink it first:\n  p2r-convert-checkpoint delink "
                              f"{load_dir} {load_dir.rstrip('/')}_real {target_flags(run_layout)}")
    if phase != run_phase:
        raise CheckpointError(f"{where}: p2r.phase is {phase!r}, this run is --p2r-phase {run_phase}; "
                              "a real checkpoint cannot be loaded into a pseudo-phase run")
    if tuple(meta["p2r"]["layer_module_keys"]) != ParallelPlan.model_parallel(cfg).layer_keys:
        raise CheckpointError(f"{where}: p2r.share_pattern is {meta['p2r']['share_pattern']!r}, this run has "
                              f"--share-pattern {cfg.p2r.share_pattern!r}; the layer->slot maps differ")
    if saved_layout.to_json() != run_layout.to_json():
        suffix = f"tp{run_layout.tp}_pp{run_layout.pp}_ep{run_layout.ep}"
        raise CheckpointError(
            f"{where}: the checkpoint was saved with {_describe(saved_layout)}; this run uses "
            f"{_describe(run_layout)}. Reshard it first:\n  p2r-convert-checkpoint reshard {load_dir} "
            f"{load_dir.rstrip('/')}_{suffix} {target_flags(run_layout)}\nthen pass --load with the new directory")


def _check_tables(saved: Dict[str, TensorInfo], run: Dict[str, TensorInfo], where: str) -> None:
    for key, info in run.items():
        if key not in saved:
            raise CheckpointError(f"{where}: tensors has no {key!r}, which this run's model needs")
        if saved[key].shape != info.shape or saved[key].dtype != info.dtype:
            raise CheckpointError(f"{where}: tensors[{key!r}] is {saved[key].dtype}{list(saved[key].shape)}, "
                                  f"this run's model needs {info.dtype}{list(info.shape)}")
    extra = set(saved) - set(run)
    if extra:
        raise CheckpointError(f"{where}: tensors lists {len(extra)} tensors this run's model does not have, "
                              f"e.g. {sorted(extra)[0]!r}")


# ----------------------------------------------------------------------------- load

def load_checkpoint(load_dir: str, state, finetune: bool = False) -> Optional[str]:
    """Restore ``state`` from ``load_dir``; with ``finetune`` only the weights. Returns the directory
    read, or None when ``--load`` is the ``--save`` directory and holds no checkpoint yet (the
    first launch of a job that always passes both)."""
    cfg, ps = state.cfg, state.ps
    ck = cfg.checkpoint
    if (ck.save and os.path.realpath(ck.save) == os.path.realpath(load_dir)
            and not os.path.exists(os.path.join(load_dir, LATEST_FILE))):
        if ps.rank == 0:
            print(f"no checkpoint in {load_dir} yet (--load is the --save directory); starting from scratch",
                  flush=True)
        return None
    iter_dir = resolve_iteration_dir(load_dir)
    meta = read_metadata(iter_dir)
    check_compatible(meta, cfg, iter_dir, load_dir)
    table = metadata_table(meta)
    _check_tables(table, tensor_table(cfg), os.path.join(iter_dir, "metadata.json"))
    layout = ShardLayout.of(cfg)
    readers = ReaderCache(iter_dir)
    load_optim = meta["optimizer"] and not finetune and not ck.no_load_optim
    kinds = ("model",) + (OPTIM_KINDS if load_optim else ())
    moments: Dict[torch.nn.Parameter, dict] = {}
    checked = set()
    with torch.no_grad():
        for info, param, j in rank_pieces(state.model, ps, table):
            name = layout.file_of(info, ps.tp_rank)
            reader = readers(name)
            if name not in checked:
                recorded = meta["files"].get(name)
                if recorded != reader.size:
                    raise CheckpointError(f"{reader.path}: {reader.size} bytes, but metadata.json files[{name!r}] "
                                          f"records {recorded} (truncated or replaced?)")
                checked.add(name)
            local = layout.local_shape(info)
            for kind in kinds:
                entry = entry_name(kind, info.key)
                shape = () if kind == "step" else local
                reader.check(entry, "F32" if kind == "step" else info.dtype, shape)
                value = reader.read(entry)
                if kind == "model":
                    (param if j is None else param[j]).copy_(value)
                elif kind == "step":
                    moments.setdefault(param, {})["step"] = value.clone()
                else:
                    buf = moments.setdefault(param, {}).setdefault(kind, torch.empty_like(param))
                    (buf if j is None else buf[j]).copy_(value)
    if load_optim:
        _load_optimizer(state.optimizer, moments)
    if not finetune:
        state.iteration, state.consumed_samples = int(meta["iteration"]), int(meta["consumed_samples"])
        try:
            state.scheduler.load_state_dict(meta["scheduler"])
            state.scaler.load_state_dict(meta["scaler"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{os.path.join(iter_dir, 'metadata.json')}: fields 'scheduler'/'scaler' are "
                                  f"malformed ({exc!r})") from None
        if not ck.no_load_rng:
            _load_rng(iter_dir, meta, ps)
    if ps.rank == 0:
        what = "weights only" if finetune else ("without optimizer state" if not load_optim else "full state")
        print(f"loaded checkpoint {iter_dir} (iteration {meta['iteration']}, consumed samples "
              f"{meta['consumed_samples']}; {what})", flush=True)
    return iter_dir


def _load_optimizer(optimizer: torch.optim.Optimizer, moments: Dict[torch.nn.Parameter, dict]) -> None:
    """Hand the moments to torch's own ``load_state_dict`` (it places ``step`` as AdamW expects)."""
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sd["state"] = {i: moments[p] for i, p in enumerate(params)}
    optimizer.load_state_dict(sd)


def _load_rng(iter_dir: str, meta: dict, ps: ParallelState) -> None:
    """Restore this rank's RNG streams. They are seeded by (tp, pp) only, so with a different DP
    the state of data-parallel rank 0 at the same (tp, pp) is the right one."""
    info = meta.get("rng")
    if not info:
        if ps.rank == 0:
            print(f"{iter_dir}: no RNG states (converted checkpoint); continuing with this run's seeds", flush=True)
        return
    saved = Layout(tp=info["tp"], pp=info["pp"], dp=info["dp"])
    c = ps.coords
    rank = saved.rank(c.tp, c.dp if saved.dp == ps.dp_size else 0, c.pp)
    reader = ShardReader(os.path.join(iter_dir, rng_file(rank)))
    torch.set_rng_state(reader.read("cpu_rng_state").clone())
    tp_random.get_rng_tracker(ps.device).state = reader.read("model_parallel_rng_state").clone()
    if ps.device.type == "cuda":
        if "cuda_rng_state" not in reader.entries:
            raise CheckpointError(f"{reader.path}: no cuda_rng_state (saved on CPU); "
                                  "pass --no-load-rng to resume on CUDA")
        torch.cuda.set_rng_state(reader.read("cuda_rng_state"), ps.device)
