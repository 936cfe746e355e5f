"""Rewrite a checkpoint for another layout (reshard), from pseudo to real or to a finer pseudo
pattern (delink), or into a deeper model (grow), streaming.

All three are one loop over the *target* table: for each piece and each of its tensors
(weights, then moments), read the source piece's TP shards and concatenate them along the
recorded ``tp_dim`` (the global piece), transform it (delink/grow: moment rescaling, noise),
cut it into the target's TP shards and append each to its target file. Which source piece a
target piece is copied from is a layer map: target layer i reads the source module
``layer_sources[i]`` (``p2r/delink.py``; ``p2r/grow.py`` for growth). Files are safetensors written by
``ShardWriter`` (headers first), so memory holds one piece at a time: the peak is bounded by
the largest tensor, not the model.

The output goes to a staging directory of the converter's own (``staging.py``: unique, inside
the locked DST) and is moved into DST only after a verification that re-reads
every written header: each tensor the target layout needs was written exactly once with its
shape, and the parameter count equals the source's (each slot counted once per layer that
uses it when delinking). SRC is only read. ``--lr-rewarmup-iters`` is recorded in the
scheduler state (``optim/scheduler.with_rewarmup``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections import Counter
from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.compatibility import check_piece
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.expert_bias import FIELD as EXPERT_BIAS
from megatron_p2r.checkpoint.integrity import check_files, verify
from megatron_p2r.checkpoint.metadata import (
    MAX_COUNT,
    broadcast_statistics,
    build_metadata,
    kinds_of,
    metadata_config,
    metadata_table,
    read_metadata,
    write_metadata,
)
from megatron_p2r.checkpoint.naming import (
    LATEST_FILE,
    METADATA_FILE,
    RNG_DIR,
    iteration_dir_name,
    resolve_iteration_dir,
)
from megatron_p2r.convert.pieces import read_global, write_pieces
from megatron_p2r.checkpoint.parts import StoredShards
from megatron_p2r.checkpoint.staging import staged_output
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo, tensor_table
from megatron_p2r.config import Config, ConfigError, check_values, stage_layer_counts
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.moe.expert_bias import expert_bias_names
from megatron_p2r.optim.scheduler import with_rewarmup
from megatron_p2r.p2r import delink as dl
from megatron_p2r.p2r import grow as gr


@dataclasses.dataclass
class Target:
    """Target layout; None keeps the source's value."""

    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    pipeline_layer_split: Optional[str] = None
    expert_parallel_size: Optional[int] = None


@dataclasses.dataclass
class DelinkOptions:
    """A delink: every target module gets a copy of the source module its layers called."""

    optimizer_state: str = "rescale"
    noise_std: float = 0.0
    noise_relative: bool = False  # noise_std is a fraction of each tensor's own std
    lr_rewarmup_iters: int = 0  # 0: no re-warm-up
    share_pattern: str = "none"  # the target's; none is the real model


@dataclasses.dataclass
class GrowOptions(DelinkOptions):
    """A depth growth to ``num_layers`` layers (not function-preserving: see ``p2r/grow.py``)."""

    num_layers: int = 0
    method: str = "stack"


def target_config(
    src: Config, target: Target, delink: bool, share_pattern: str = "none", num_layers: Optional[int] = None
) -> Config:
    """The source config with the target layout, checked; when delinking (or growing) also with
    the target's share pattern (phase real for ``none``) and depth."""
    p, changes = src.parallel, {}
    if num_layers is not None:
        changes["num_layers"] = num_layers
        if target.pipeline_layer_split is None:
            changes["pipeline_layer_split"] = None  # the source's split is for the source's depth
    if target.tensor_parallel_size is not None:
        changes["tensor_model_parallel_size"] = target.tensor_parallel_size
    if target.pipeline_layer_split is not None:
        changes["pipeline_layer_split"] = target.pipeline_layer_split
        changes["pipeline_model_parallel_size"] = target.pipeline_parallel_size or len(
            target.pipeline_layer_split.split(",")
        )
    elif target.pipeline_parallel_size is not None:
        if target.pipeline_parallel_size != p.pipeline_model_parallel_size:
            changes["pipeline_layer_split"] = None  # a new stage count starts from the even split
        changes["pipeline_model_parallel_size"] = target.pipeline_parallel_size
    if "pipeline_model_parallel_size" in changes:  # loads take any interleaving: write the plain split
        changes.update(num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None)
    if target.expert_parallel_size is not None:
        changes["expert_model_parallel_size"] = target.expert_parallel_size
    if delink:
        changes["p2r_phase"] = "real" if share_pattern == "none" else "pseudo"
        changes["share_pattern"] = share_pattern if share_pattern != "none" else src.p2r.share_pattern
    cfg = src.replace(**changes)
    try:
        check_values(cfg)
        cfg.p2r.check(cfg.model.num_layers)
    except ConfigError as exc:
        raise ConfigError(_target_flags(str(exc))) from None
    p, m = cfg.parallel, cfg.model
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    for what, size in [
        ("--num-attention-heads", m.num_attention_heads),
        ("ffn hidden size", m.ffn_size),
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
    ] + ([("expert ffn hidden size", m.expert_ffn_size)] if m.num_experts else []):
        if size % tp:
            raise ConfigError(f"--target-tensor-parallel-size {tp} does not divide the model's {what} ({size})")
    if m.query_groups % tp and tp % m.query_groups:
        raise ConfigError(
            f"--target-tensor-parallel-size {tp} and the model's --num-query-groups "
            f"({m.query_groups}) must divide one another"
        )
    if ep > 1 and not m.num_experts:
        raise ConfigError(f"--target-expert-parallel-size {ep} needs an MoE model; this one has no experts")
    if m.num_experts and m.num_experts % ep:
        raise ConfigError(f"--target-expert-parallel-size {ep} does not divide --num-experts ({m.num_experts})")
    try:
        stage_layer_counts(m.num_layers, p.pipeline_model_parallel_size, p.pipeline_layer_split)
    except ConfigError as exc:
        raise ConfigError(_target_flags(str(exc))) from None
    return cfg


@dataclasses.dataclass(frozen=True)
class _LayerMap:
    """Where each target layer's weights come from, and how many layers call each module."""

    layer_sources: Tuple[int, ...]  # target layer -> source module key
    source_uses: Dict[int, int]  # source module key -> layers calling it in the source
    target_uses: Dict[int, int]  # target module key -> layers calling it in the target
    copies: Dict[int, int]  # source module key -> target modules copied from it

    def expected_writes(self, info: TensorInfo) -> int:
        """How many target pieces one source piece becomes."""
        return 1 if info.module_key is None else self.copies.get(info.module_key, 0)


def _layer_map(meta: dict, src_cfg: Config, dst_cfg: Config, options: Optional[DelinkOptions]) -> _LayerMap:
    """The layer map of a reshard (identity), a delink (the source's own map, checked to be
    refined by the target pattern) or a growth (``grow.grown_layers``)."""
    src_keys = list(meta["p2r"]["layer_module_keys"])
    dst_keys = list(ParallelPlan.model_parallel(dst_cfg).layer_keys)
    sources = src_keys
    if isinstance(options, GrowOptions):
        layers = gr.grown_layers(len(src_keys), options.num_layers, options.method)
        m, d = src_cfg.model, dst_cfg.model
        gr.check_layer_kinds(
            layers,
            [m.is_moe_layer(i) for i in range(m.num_layers)],
            [d.is_moe_layer(j) for j in range(d.num_layers)],
            options.method,
        )
        sources = [src_keys[i] for i in layers]
    if options is not None:
        dl.check_refinement(
            sources,
            dst_keys,
            meta["p2r"]["share_pattern"] if meta["p2r"]["phase"] == "pseudo" else "none",
            options.share_pattern,
        )
    return _LayerMap(
        tuple(sources), dl.slot_sizes(src_keys), dl.slot_sizes(dst_keys), dl.target_uses(sources, dst_keys)
    )


def _target_flags(message: str) -> str:
    """A config error about the target, in the converter's flag names."""
    for flag, target in (
        ("--tensor-model-parallel-size", "--target-tensor-parallel-size"),
        ("--pipeline-model-parallel-size", "--target-pipeline-parallel-size"),
        ("--expert-model-parallel-size", "--target-expert-parallel-size"),
        ("--pipeline-layer-split", "--target-pipeline-layer-split"),
        ("--share-pattern", "--target-share-pattern"),
    ):
        message = message.replace(flag, target)
    return message


def _plan(src: Dict[str, TensorInfo], dst: Dict[str, TensorInfo], layer_map: _LayerMap, where: str) -> Dict[str, str]:
    """target key -> source key; every source piece must be used exactly as often as expected."""
    plan, uses = {}, Counter()
    for key, info in dst.items():
        skey = dl.source_key(key, layer_map.layer_sources)
        if skey not in src:
            raise CheckpointError(
                f"{where}: the target needs {key!r} from source tensor {skey!r}, which tensors does not list"
            )
        check_piece(src[skey], info, where, skey, f"the target's {key!r}")
        plan[key] = skey
        uses[skey] += 1
    for skey, info in src.items():
        want = layer_map.expected_writes(info)
        if uses[skey] != want:
            raise CheckpointError(
                f"{where}: source tensor {skey!r} would be written {uses[skey]} times, "
                f"expected {want}; refusing to drop or duplicate tensors"
            )
    return plan


def _check_options(meta: dict, options: Optional[DelinkOptions], where: str) -> None:
    if options is None:
        return
    if not isinstance(options, GrowOptions) and meta["p2r"]["phase"] != "pseudo":
        raise CheckpointError(
            f"{where}: p2r.phase is {meta['p2r']['phase']!r}; delink needs a pseudo-phase "
            "checkpoint (use reshard to change a real checkpoint's layout)"
        )
    if options.optimizer_state not in dl.OPTIMIZER_STATE_MODES:
        raise ConfigError(
            f"--optimizer-state must be one of {dl.OPTIMIZER_STATE_MODES}, got {options.optimizer_state!r}"
        )
    if not (isinstance(options.noise_std, (int, float)) and 0.0 <= options.noise_std <= dl.MAX_NOISE_STD):
        scale = "of each tensor's own std" if options.noise_relative else "(initialised weights have std ~0.02)"
        raise ConfigError(f"--noise-std must be a number in [0, {dl.MAX_NOISE_STD:g}] {scale}, got {options.noise_std}")
    if not 0 <= options.lr_rewarmup_iters <= MAX_COUNT:
        raise ConfigError(
            f"--lr-rewarmup-iters must be in [0, {MAX_COUNT}] (what a checkpoint records), "
            f"got {options.lr_rewarmup_iters}"
        )
    if options.lr_rewarmup_iters and not isinstance(meta.get("scheduler"), dict):
        raise CheckpointError(
            f"{where}: --lr-rewarmup-iters needs the checkpoint's field 'scheduler', which it does not have"
        )


def convert(
    src: str,
    dst: str,
    target: Target,
    options: Optional[DelinkOptions] = None,
    *,
    force: bool = False,
    progress: bool = True,
) -> str:
    """Reshard (``options`` None), delink (``DelinkOptions``) or grow (``GrowOptions``) SRC into
    DST; returns DST's iteration directory."""
    src_iter = resolve_iteration_dir(src)
    where = os.path.join(src_iter, METADATA_FILE)
    meta = read_metadata(src_iter)
    readers = check_files(src_iter, meta)
    src_cfg = metadata_config(meta)
    _check_options(meta, options, where)
    grow = isinstance(options, GrowOptions)
    op = "grow" if grow else "delink" if options else "reshard"
    dst_cfg = target_config(
        src_cfg,
        target,
        options is not None,
        options.share_pattern if options else "none",
        options.num_layers if grow else None,
    )
    layer_map = _layer_map(meta, src_cfg, dst_cfg, options)
    src_table, dst_table = metadata_table(meta), tensor_table(dst_cfg)
    src_layout, dst_layout = ShardLayout.of(src_cfg), ShardLayout.of(dst_cfg)
    plan = _plan(src_table, dst_table, layer_map, where)
    kinds = ("model",) if options is not None and options.optimizer_state == "reset" else kinds_of(meta)

    iteration = int(meta["iteration"])
    with staged_output(src, src_iter, dst, force) as tmp:
        out_iter = os.path.join(tmp, iteration_dir_name(iteration))
        os.makedirs(out_iter)
        transform = None
        if options is not None:
            transform = functools.partial(_copy_tensor, options, layer_map, src_cfg.train.seed)
        checksums = _write_tensors(
            out_iter,
            readers,
            (src_table, src_layout, broadcast_statistics(meta)),
            dst_table,
            dst_layout,
            plan,
            kinds,
            transform,
            progress,
            op,
        )
        files = {f: os.path.getsize(os.path.join(out_iter, f)) for f in dst_layout.files()}
        keeps_rng = options is None and src_layout == dst_layout
        rng = _copy_rng(src_iter, out_iter, meta, checksums) if keeps_rng and meta.get("rng") else None
        scheduler = _scheduler(meta, options)
        step = _history_step(op, src_iter, src_layout, options)
        new_meta = build_metadata(
            dst_cfg,
            dst_table,
            iteration=iteration,
            consumed_samples=meta["consumed_samples"],
            optimizer="step" in kinds,
            optimizer_kinds=kinds[1:],
            scheduler=scheduler,
            scaler=meta.get("scaler"),
            files=files,
            rng=rng,
            history=list(meta.get("history", [])) + [step],
            checksums=checksums,
            expert_bias=_expert_biases(meta, dst_cfg, layer_map),
        )
        write_metadata(out_iter, new_meta)
        verify(
            out_iter, new_meta, expected_params=sum(i.numel * layer_map.expected_writes(i) for i in src_table.values())
        )
        write_text_atomic(os.path.join(tmp, LATEST_FILE), str(iteration))
    return os.path.join(dst, iteration_dir_name(iteration))


def _expert_biases(meta: dict, dst_cfg, layer_map: _LayerMap) -> Optional[dict]:
    """The target's routers' biases: each module's from the source module whose weights it copies
    (the same module when resharding; the slot a layer used when delinking or growing); the MTP
    depths' as they are (none in a checkpoint older than them: they start at 0)."""
    saved = meta.get(EXPERT_BIAS)
    if not saved or not dst_cfg.model.moe_router_enable_expert_bias:
        return None
    names = expert_bias_names(dst_cfg.model, ParallelPlan.model_parallel(dst_cfg).layer_keys)
    sources = {name: dl.source_key(name, layer_map.layer_sources) for name in names}
    return {name: saved[src] for name, src in sources.items() if src in saved or not name.startswith("mtp.")}


def _scheduler(meta: dict, options: Optional[DelinkOptions]) -> Optional[dict]:
    """The source's LR schedule, re-warmed up when the delink or growth asks for it."""
    scheduler = meta.get("scheduler")
    if options is not None and options.lr_rewarmup_iters:
        scheduler = with_rewarmup(scheduler, options.lr_rewarmup_iters)
    return scheduler


def _history_step(op: str, src_iter: str, src_layout: ShardLayout, options: Optional[DelinkOptions]) -> dict:
    """The record of this conversion in the checkpoint's history."""
    return {
        "op": op,
        "source": os.path.abspath(src_iter),
        "source_layout": src_layout.to_json(),
        **(dataclasses.asdict(options) if options else {}),
    }


def _copy_rng(src_iter: str, out_iter: str, meta: dict, checksums: dict) -> dict:
    """A reshard onto the same layout keeps each rank's RNG state (files and their checksums)."""
    shutil.copytree(os.path.join(src_iter, RNG_DIR), os.path.join(out_iter, RNG_DIR))
    checksums.update((k, v) for k, v in (meta.get("crc32") or {}).items() if k.startswith(RNG_DIR + "/"))
    return meta["rng"]


def _copy_tensor(
    options: DelinkOptions,
    layer_map: _LayerMap,
    seed: int,
    kind: str,
    tensor: torch.Tensor,
    dst_key: str,
    src: TensorInfo,
) -> torch.Tensor:
    """A source piece as its delinked or grown copy ``dst_key``: noisy weights, rescaled moments."""
    if src.module_key is None:
        return tensor
    if kind == "model":
        return dl.add_noise(tensor, dst_key, options.noise_std, seed, options.noise_relative)
    target_module = dl.layer_of(dst_key)
    return dl.delink_moment(
        kind,
        tensor,
        layer_map.source_uses[src.module_key],
        layer_map.target_uses[target_module],
        options.optimizer_state,
    )


def _write_tensors(
    out_iter: str,
    readers: StoredShards,
    source: Tuple[Dict[str, TensorInfo], ShardLayout, bool],
    dst_table: Dict[str, TensorInfo],
    dst_layout: ShardLayout,
    plan: Dict[str, str],
    kinds,
    transform: Optional[Callable],
    progress: bool,
    desc: str,
) -> Dict[str, Dict[str, int]]:
    """Each target piece and kind: the source piece read whole, transformed, cut into the target's
    shards. ``source``: its table, layout and whether it stores Adafactor's statistics broadcast
    (then written factored, as every new checkpoint)."""
    src_table, src_layout, broadcast = source

    def produce(info: TensorInfo, kind: str) -> torch.Tensor:
        sinfo = src_table[plan[info.key]]
        tensor = read_global(readers, src_layout, sinfo, kind, broadcast)
        return tensor if transform is None else transform(kind, tensor, info.key, sinfo)

    return write_pieces(out_iter, dst_table, dst_layout, kinds, produce, progress=progress, desc=desc)
