"""Rewrite a checkpoint for another layout (reshard) or from pseudo to real (delink), streaming.

Both are one loop over the *target* table: for each piece and each of its tensors (weights,
then moments), read the source piece's TP shards and concatenate them along the recorded
``tp_dim`` (the global piece), transform it (delink: moment rescaling, noise), cut it into the
target's TP shards and append each to its target file. Files are safetensors written by
``ShardWriter`` (headers first), so memory holds one piece at a time: the peak is bounded by
the largest tensor, not the model.

The output goes to ``DST.tmp`` and is renamed to DST only after a verification that re-reads
every written header: each tensor the target layout needs was written exactly once with its
shape, and the parameter count equals the source's (each slot counted once per layer that
uses it when delinking). SRC is only read.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections import Counter
from typing import Callable, Dict, Optional

import torch
from tqdm import tqdm

from megatron_p2r.checkpoint.format import (
    _TORCH_DTYPES, LATEST_FILE, METADATA_FILE, RNG_DIR, CheckpointError, ReaderCache, ShardLayout, ShardWriter,
    TensorInfo, check_files, entry_name, file_entries, iteration_dir_name, kinds_of, metadata_config,
    metadata_table, read_metadata, resolve_iteration_dir, shard_header_metadata, tensor_table, write_metadata,
    write_text_atomic)
from megatron_p2r.checkpoint.io import build_metadata
from megatron_p2r.config import Config, ConfigError
from megatron_p2r.p2r import delink as dl
from megatron_p2r.pipeline.partition import stage_layer_counts


@dataclasses.dataclass
class Target:
    """Target layout; None keeps the source's value."""

    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    pipeline_layer_split: Optional[str] = None
    expert_parallel_size: Optional[int] = None


@dataclasses.dataclass
class DelinkOptions:
    optimizer_state: str = "rescale"
    noise_std: float = 0.0


def target_config(src: Config, target: Target, delink: bool) -> Config:
    """The source config with the target layout (and the real phase when delinking), checked."""
    cfg = Config.from_dict(src.to_dict())
    p, m = cfg.parallel, cfg.model
    if target.tensor_parallel_size is not None:
        p.tensor_model_parallel_size = target.tensor_parallel_size
    if target.pipeline_layer_split is not None:
        p.pipeline_layer_split = target.pipeline_layer_split
        p.pipeline_model_parallel_size = target.pipeline_parallel_size or len(target.pipeline_layer_split.split(","))
    elif target.pipeline_parallel_size is not None:
        if target.pipeline_parallel_size != p.pipeline_model_parallel_size:
            p.pipeline_layer_split = None  # a new stage count starts from the even split
        p.pipeline_model_parallel_size = target.pipeline_parallel_size
    if target.expert_parallel_size is not None:
        p.expert_model_parallel_size = target.expert_parallel_size
    if delink:
        cfg.p2r.p2r_phase = "real"
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    for value, flag in [(tp, "--target-tensor-parallel-size"), (p.pipeline_model_parallel_size,
                        "--target-pipeline-parallel-size"), (ep, "--target-expert-parallel-size")]:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    for what, size in [("--num-attention-heads", m.num_attention_heads), ("ffn hidden size", m.ffn_size),
                       ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)] + \
            ([("expert ffn hidden size", m.expert_ffn_size)] if m.num_experts else []):
        if size % tp:
            raise ConfigError(f"--target-tensor-parallel-size {tp} does not divide the model's {what} ({size})")
    if ep > 1 and not m.num_experts:
        raise ConfigError(f"--target-expert-parallel-size {ep} needs an MoE model; this one has no experts")
    if m.num_experts and m.num_experts % ep:
        raise ConfigError(f"--target-expert-parallel-size {ep} does not divide --num-experts ({m.num_experts})")
    try:
        stage_layer_counts(m.num_layers, p.pipeline_model_parallel_size, p.pipeline_layer_split)
    except ConfigError as exc:
        msg = str(exc).replace("--pipeline-model-parallel-size", "--target-pipeline-parallel-size")
        raise ConfigError(msg.replace("--pipeline-layer-split", "--target-pipeline-layer-split")) from None
    return cfg


def _plan(src: Dict[str, TensorInfo], dst: Dict[str, TensorInfo], layer_keys, delink: bool,
          where: str) -> Dict[str, str]:
    """target key -> source key; every source piece must be used exactly as often as expected."""
    plan, uses = {}, Counter()
    for key, info in dst.items():
        skey = dl.source_key(key, layer_keys) if delink else key
        if skey not in src:
            raise CheckpointError(f"{where}: the target needs {key!r} from source tensor {skey!r}, "
                                  f"which tensors does not list")
        if src[skey].shape != info.shape or src[skey].dtype != info.dtype:
            raise CheckpointError(f"{where}: tensors[{skey!r}] is {src[skey].dtype}{list(src[skey].shape)}, "
                                  f"the target's {key!r} needs {info.dtype}{list(info.shape)}")
        plan[key] = skey
        uses[skey] += 1
    for skey, info in src.items():
        want = _factor(info, delink)
        if uses[skey] != want:
            raise CheckpointError(f"{where}: source tensor {skey!r} would be written {uses[skey]} times, "
                                  f"expected {want}; refusing to drop or duplicate tensors")
    return plan


def _factor(info: TensorInfo, delink: bool) -> int:
    """How many target pieces one source piece becomes (layers using the slot, when delinking)."""
    return len(info.layers) if delink and info.module_key is not None else 1


def _read_global(readers: ReaderCache, layout: ShardLayout, info: TensorInfo, kind: str) -> torch.Tensor:
    """The whole piece: its TP shards read into one tensor (straight into place along dim 0)."""
    entry = entry_name(kind, info.key)
    if kind == "step" or info.tp_dim is None or layout.tp == 1:
        return readers(layout.file_of(info, 0)).read(entry)
    out = torch.empty(info.shape, dtype=_TORCH_DTYPES[info.dtype])
    for t, part in enumerate(out.chunk(layout.tp, dim=info.tp_dim)):
        reader = readers(layout.file_of(info, t))
        if part.is_contiguous():
            reader.read(entry, out=part)
        else:
            part.copy_(reader.read(entry))
    return out


def _shards(tensor: torch.Tensor, info: TensorInfo, layout: ShardLayout, kind: str):
    if kind == "step" or info.tp_dim is None:
        return [(t, tensor) for t in layout.tp_ranks_of(info)]
    return list(enumerate(tensor.chunk(layout.tp, dim=info.tp_dim)))


def convert(src: str, dst: str, target: Target, delink: Optional[DelinkOptions] = None, *,
            force: bool = False, progress: bool = True) -> str:
    """Reshard (``delink`` None) or delink SRC into DST; returns DST's iteration directory."""
    src_iter = resolve_iteration_dir(src)
    where = os.path.join(src_iter, METADATA_FILE)
    meta = read_metadata(src_iter)
    readers = check_files(src_iter, meta)
    src_cfg = metadata_config(meta)
    if delink is not None:
        if meta["p2r"]["phase"] != "pseudo":
            raise CheckpointError(f"{where}: p2r.phase is {meta['p2r']['phase']!r}; delink needs a pseudo-phase "
                                  "checkpoint (use reshard to change a real checkpoint's layout)")
        if delink.optimizer_state not in dl.OPTIMIZER_STATE_MODES:
            raise ConfigError(f"--optimizer-state must be one of {dl.OPTIMIZER_STATE_MODES}, "
                              f"got {delink.optimizer_state!r}")
    dst_cfg = target_config(src_cfg, target, delink is not None)
    src_table, dst_table = metadata_table(meta), tensor_table(dst_cfg)
    src_layout, dst_layout = ShardLayout.of(src_cfg), ShardLayout.of(dst_cfg)
    layer_keys = meta["p2r"]["layer_module_keys"]
    plan = _plan(src_table, dst_table, layer_keys, delink is not None, where)
    reset = delink is not None and delink.optimizer_state == "reset"
    kinds = ("model",) if reset else kinds_of(meta)

    tmp = _prepare_destination(src, src_iter, dst, force)
    try:
        iteration = int(meta["iteration"])
        out_iter = os.path.join(tmp, iteration_dir_name(iteration))
        os.makedirs(out_iter)
        transform = None
        if delink is not None:
            transform = functools.partial(_delink_tensor, delink, dl.slot_sizes(layer_keys), src_cfg.train.seed)
        _write_tensors(out_iter, readers, src_table, src_layout, dst_table, dst_layout, plan, kinds, transform,
                       progress, "delink" if delink else "reshard")
        files = {f: os.path.getsize(os.path.join(out_iter, f)) for f in dst_layout.files()}
        rng = None
        if delink is None and src_layout == dst_layout and meta.get("rng"):
            shutil.copytree(os.path.join(src_iter, RNG_DIR), os.path.join(out_iter, RNG_DIR))
            rng = meta["rng"]
        step = {"op": "delink" if delink else "reshard", "source": os.path.abspath(src_iter),
                "source_layout": src_layout.to_json(), **(dataclasses.asdict(delink) if delink else {})}
        new_meta = build_metadata(dst_cfg, dst_table, iteration=iteration, consumed_samples=meta["consumed_samples"],
                                  optimizer="exp_avg" in kinds, scheduler=meta.get("scheduler"),
                                  scaler=meta.get("scaler"), files=files, rng=rng,
                                  history=list(meta.get("history", [])) + [step])
        write_metadata(out_iter, new_meta)
        verify(out_iter, new_meta, expected_params=sum(i.numel * _factor(i, delink is not None)
                                                       for i in src_table.values()))
        write_text_atomic(os.path.join(tmp, LATEST_FILE), str(iteration))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_staged(tmp, dst)
    return os.path.join(dst, iteration_dir_name(iteration))


def publish_staged(tmp: str, dst: str) -> None:
    """Replace ``dst`` by the completed ``tmp`` (an existing ``dst`` only with --force, checked
    before anything was written)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.rename(tmp, dst)


def _delink_tensor(options: DelinkOptions, sizes: Dict[int, int], seed: int, kind: str, tensor: torch.Tensor,
                   dst_key: str, src: TensorInfo) -> torch.Tensor:
    if src.module_key is None:
        return tensor
    if kind == "model":
        return dl.add_noise(tensor, dst_key, options.noise_std, seed)
    return dl.delink_moment(kind, tensor, sizes[src.module_key], options.optimizer_state)


def _write_tensors(out_iter: str, readers: ReaderCache, src_table: Dict[str, TensorInfo], src_layout: ShardLayout,
                   dst_table: Dict[str, TensorInfo], dst_layout: ShardLayout, plan: Dict[str, str], kinds,
                   transform: Optional[Callable], progress: bool, desc: str) -> None:
    """The streaming loop: one global piece in memory at a time, files of one stage open at a time."""
    entries = file_entries(dst_table, dst_layout, kinds)
    total = sum(info.nbytes * (len(kinds) - ("step" in kinds)) for info in dst_table.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=desc)
    writers: Dict[str, ShardWriter] = {}
    stage = -1
    for key, info in dst_table.items():
        if info.stage != stage:
            _close_all(writers)
            stage = info.stage
            for name in dst_layout.stage_files(stage):
                writers[name] = ShardWriter(os.path.join(out_iter, name), entries[name], shard_header_metadata(name))
        for kind in kinds:
            nbytes = _copy_piece(readers, src_table[plan[key]], src_layout, info, dst_layout, kind, writers,
                                 transform)
            bar.update(nbytes if kind != "step" else 0)
    _close_all(writers)
    # A stage can own no piece (a middle stage that only replays a pseudo slot of an earlier
    # stage); the layout still has its (empty) files.
    for name, ents in entries.items():
        if not os.path.exists(os.path.join(out_iter, name)):
            ShardWriter(os.path.join(out_iter, name), ents, shard_header_metadata(name)).close()
    bar.close()


def _copy_piece(readers: ReaderCache, sinfo: TensorInfo, src_layout: ShardLayout, info: TensorInfo,
                dst_layout: ShardLayout, kind: str, writers: Dict[str, ShardWriter],
                transform: Optional[Callable]) -> int:
    """Read one global tensor, transform it, append its target shards; returns its bytes.
    (A function of its own so that nothing of the piece outlives it.)"""
    tensor = _read_global(readers, src_layout, sinfo, kind)
    if transform is not None:
        tensor = transform(kind, tensor, info.key, sinfo)
    for t, shard in _shards(tensor, info, dst_layout, kind):
        writers[dst_layout.file_of(info, t)].write(entry_name(kind, info.key), shard)
    return tensor.numel() * tensor.element_size()


def _close_all(writers: Dict[str, ShardWriter]) -> None:
    for w in writers.values():
        w.close()
    writers.clear()


def _prepare_destination(src: str, src_iter: str, dst: str, force: bool) -> str:
    a, b = os.path.realpath(src), os.path.realpath(dst)
    for s in {a, os.path.realpath(src_iter)}:
        if b == s or b.startswith(s + os.sep) or s.startswith(b + os.sep):
            raise CheckpointError(f"DST {dst} overlaps SRC {src}; the converter never writes into its source")
    if os.path.islink(dst):
        raise CheckpointError(f"DST {dst} is a symbolic link; pass the directory it points to "
                              f"({os.path.realpath(dst)}) if that is where the result belongs")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)) and not force:
        raise CheckpointError(f"DST {dst} exists and is not empty; pass --force to replace it")
    tmp = b.rstrip(os.sep) + ".tmp"
    if os.path.islink(tmp) or os.path.isfile(tmp):  # never write through a link planted at DST.tmp
        os.unlink(tmp)
    elif os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def verify(iter_dir: str, meta: dict, expected_params: int) -> None:
    """Re-read every header: each needed tensor present exactly once, right shape, nothing extra;
    the parameter count (and each moment's element count) equals ``expected_params``."""
    readers = check_files(iter_dir, meta)  # exact per-file entry sets, shapes, sizes
    seen = Counter()
    totals = Counter()
    for name in meta["files"]:
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
                raise CheckpointError(f"{iter_dir}: {name!r} written {seen[name]} times, "
                                      f"expected {len(layout.tp_ranks_of(info))} (one per TP shard)")
    for kind in [k for k in kinds_of(meta) if k != "step"]:
        if totals[kind] != expected_params:
            raise CheckpointError(f"{iter_dir}: {kind} holds {totals[kind]:,} elements, the source implies "
                                  f"{expected_params:,}; refusing to publish an incomplete conversion")
