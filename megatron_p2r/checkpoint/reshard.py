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

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.integrity import check_files, verify
from megatron_p2r.checkpoint.metadata import (build_metadata, kinds_of, metadata_config, metadata_table, read_metadata,
                                              write_metadata)
from megatron_p2r.checkpoint.naming import (LATEST_FILE, METADATA_FILE, RNG_DIR, iteration_dir_name,
                                            resolve_iteration_dir)
from megatron_p2r.checkpoint.pieces import read_global, write_pieces
from megatron_p2r.checkpoint.safetensors_io import ReaderCache
from megatron_p2r.checkpoint.staging import staged_output
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo, tensor_table
from megatron_p2r.config import Config, ConfigError, stage_layer_counts
from megatron_p2r.p2r import delink as dl


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
    p, changes = src.parallel, {}
    if target.tensor_parallel_size is not None:
        changes["tensor_model_parallel_size"] = target.tensor_parallel_size
    if target.pipeline_layer_split is not None:
        changes["pipeline_layer_split"] = target.pipeline_layer_split
        changes["pipeline_model_parallel_size"] = (target.pipeline_parallel_size
                                                   or len(target.pipeline_layer_split.split(",")))
    elif target.pipeline_parallel_size is not None:
        if target.pipeline_parallel_size != p.pipeline_model_parallel_size:
            changes["pipeline_layer_split"] = None  # a new stage count starts from the even split
        changes["pipeline_model_parallel_size"] = target.pipeline_parallel_size
    if "pipeline_model_parallel_size" in changes:  # loads take any interleaving: write the plain split
        changes.update(num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None)
    if target.expert_parallel_size is not None:
        changes["expert_model_parallel_size"] = target.expert_parallel_size
    if delink:
        changes["p2r_phase"] = "real"
    cfg = src.replace(**changes)
    p, m = cfg.parallel, cfg.model
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
    if m.query_groups % tp and tp % m.query_groups:
        raise ConfigError(f"--target-tensor-parallel-size {tp} and the model's --num-query-groups "
                          f"({m.query_groups}) must divide one another")
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
        if src[skey].rows != info.rows:
            raise CheckpointError(f"{where}: tensors[{skey!r}].rows is {src[skey].rows}, the target's {key!r} "
                                  f"needs {info.rows}")
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

    iteration = int(meta["iteration"])
    with staged_output(src, src_iter, dst, force) as tmp:
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
    return os.path.join(dst, iteration_dir_name(iteration))


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
    """Each target piece and kind: the source piece read whole, transformed, cut into the target's shards."""
    def produce(info: TensorInfo, kind: str) -> torch.Tensor:
        sinfo = src_table[plan[info.key]]
        tensor = read_global(readers, src_layout, sinfo, kind)
        return tensor if transform is None else transform(kind, tensor, info.key, sinfo)

    write_pieces(out_iter, dst_table, dst_layout, kinds, produce, progress=progress, desc=desc)
