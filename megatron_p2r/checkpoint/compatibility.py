"""Can this run load that checkpoint? Model shape, P2R phase and parallel layout are compared
before any tensor is read; a mismatch fails naming the field and the flag, and the converter
command that fixes it when there is one."""

from __future__ import annotations

import os
from typing import Dict

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.metadata import metadata_config
from megatron_p2r.checkpoint.naming import METADATA_FILE
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo
from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan

# Model fields that decide tensor shapes: (name shown, flag, value getter).
_STRUCTURE = [
    ("num_layers", "--num-layers", lambda m: m.num_layers),
    ("hidden_size", "--hidden-size", lambda m: m.hidden_size),
    ("ffn_hidden_size", "--ffn-hidden-size", lambda m: m.ffn_size),
    ("num_attention_heads", "--num-attention-heads", lambda m: m.num_attention_heads),
    ("group_query_attention", "--group-query-attention", lambda m: m.group_query_attention),
    ("num_query_groups", "--num-query-groups", lambda m: m.query_groups),
    ("kv_channels", "--kv-channels", lambda m: m.head_dim),
    ("qk_layernorm", "--qk-layernorm", lambda m: m.qk_layernorm),
    ("add_qkv_bias", "--add-qkv-bias", lambda m: m.qkv_bias),
    ("softmax_type", "--softmax-type", lambda m: m.softmax_type),
    ("multi_latent_attention", "--multi-latent-attention", lambda m: m.multi_latent_attention),
    ("q_lora_rank", "--q-lora-rank", lambda m: m.q_lora_rank if m.multi_latent_attention else None),
    ("kv_lora_rank", "--kv-lora-rank", lambda m: m.kv_lora_rank if m.multi_latent_attention else None),
    ("qk_head_dim", "--qk-head-dim", lambda m: m.qk_head_dim if m.multi_latent_attention else None),
    (
        "qk_pos_emb_head_dim",
        "--qk-pos-emb-head-dim",
        lambda m: m.qk_pos_emb_head_dim if m.multi_latent_attention else None,
    ),
    ("v_head_dim", "--v-head-dim", lambda m: m.v_head_dim if m.multi_latent_attention else None),
    ("padded_vocab_size", "--vocab-size/--make-vocab-size-divisible-by", lambda m: m.padded_vocab_size),
    ("normalization", "--normalization", lambda m: m.normalization),
    ("swiglu", "--swiglu", lambda m: m.swiglu),
    ("position_embedding_type", "--position-embedding-type", lambda m: m.position_embedding_type),
    (
        "max_position_embeddings",
        "--max-position-embeddings",
        lambda m: m.max_positions if m.position_embedding_type == "learned_absolute" else None,
    ),
    (
        "untie_embeddings_and_output_weights",
        "--untie-embeddings-and-output-weights",
        lambda m: m.untie_embeddings_and_output_weights,
    ),
    ("disable_bias_linear", "--disable-bias-linear", lambda m: m.disable_bias_linear),
    ("num_experts", "--num-experts", lambda m: m.num_experts),
    ("moe_router_bias", "--no-moe-router-bias", lambda m: m.router_bias if m.num_experts else None),
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
    counts = [b - a for a, b in layout.stage_layers]
    chunks = len(counts) // layout.pp
    split = "layers per stage" if chunks == 1 else f"{chunks} model chunks per stage, layers per virtual stage"
    return f"TP={layout.tp}, PP={layout.pp} ({split} {counts}), EP={layout.ep}"


def check_compatible(meta: dict, cfg: Config, iter_dir: str, load_dir: str) -> None:
    """Fail unless the checkpoint's model, phase and TP/PP/EP are the run's. Which layers each
    pipeline stage holds (the split, the interleaving) may differ: a rank reads each piece from
    the file the checkpoint's table names, and the shard shapes depend on TP and EP only."""
    where = os.path.join(iter_dir, METADATA_FILE)
    saved = metadata_config(meta)
    for name, flag, get in _STRUCTURE:
        a, b = get(saved.model), get(cfg.model)
        if a != b:
            raise CheckpointError(
                f"{where}: the checkpoint's model has {name} = {a!r}, this run has {b!r} "
                f"({flag}); the model shape must match to load"
            )
    phase, run_phase = meta["p2r"]["phase"], cfg.p2r.p2r_phase
    run_layout, saved_layout = ShardLayout.of(cfg), ShardLayout.of(saved)
    if phase == "pseudo" and run_phase == "real":
        raise CheckpointError(
            f"{where}: p2r.phase is 'pseudo' (share pattern {meta['p2r']['share_pattern']}), "
            f"this run is --p2r-phase real. Delink it first:\n  p2r-convert-checkpoint delink "
            f"{load_dir} {load_dir.rstrip('/')}_real {target_flags(run_layout)}"
        )
    if phase != run_phase:
        raise CheckpointError(
            f"{where}: p2r.phase is {phase!r}, this run is --p2r-phase {run_phase}; "
            "a real checkpoint cannot be loaded into a pseudo-phase run"
        )
    if tuple(meta["p2r"]["layer_module_keys"]) != ParallelPlan.model_parallel(cfg).layer_keys:
        raise CheckpointError(
            f"{where}: p2r.share_pattern is {meta['p2r']['share_pattern']!r}, this run has "
            f"--share-pattern {cfg.p2r.share_pattern!r}; the layer->slot maps differ"
        )
    if (saved_layout.tp, saved_layout.pp, saved_layout.ep) != (run_layout.tp, run_layout.pp, run_layout.ep):
        suffix = f"tp{run_layout.tp}_pp{run_layout.pp}_ep{run_layout.ep}"
        raise CheckpointError(
            f"{where}: the checkpoint was saved with {_describe(saved_layout)}; this run uses "
            f"{_describe(run_layout)}. Reshard it first:\n  p2r-convert-checkpoint reshard {load_dir} "
            f"{load_dir.rstrip('/')}_{suffix} {target_flags(run_layout)}\nthen pass --load with the new directory"
        )


def _rows(info: TensorInfo):
    return None if info.rows is None else info.rows.to_json()


def check_piece(stored: TensorInfo, wanted: TensorInfo, where: str, key: str, wanted_by: str) -> None:
    """Fail unless the stored piece ``key`` has the shape, dtype and row layout ``wanted_by`` needs."""
    if stored.shape != wanted.shape or stored.dtype != wanted.dtype:
        raise CheckpointError(
            f"{where}: tensors[{key!r}] is {stored.dtype}{list(stored.shape)}, "
            f"{wanted_by} needs {wanted.dtype}{list(wanted.shape)}"
        )
    if stored.rows != wanted.rows:
        raise CheckpointError(
            f"{where}: tensors[{key!r}].rows is {_rows(stored)}, {wanted_by} lays its rows out as {_rows(wanted)}"
        )


def check_tables(saved: Dict[str, TensorInfo], run: Dict[str, TensorInfo], where: str) -> None:
    """Fail unless the checkpoint lists exactly the run's pieces, with the run's shapes and dtypes."""
    for key, info in run.items():
        if key not in saved:
            raise CheckpointError(f"{where}: tensors has no {key!r}, which this run's model needs")
        check_piece(saved[key], info, where, key, "this run's model")
    extra = set(saved) - set(run)
    if extra:
        raise CheckpointError(
            f"{where}: tensors lists {len(extra)} tensors this run's model does not have, e.g. {sorted(extra)[0]!r}"
        )
