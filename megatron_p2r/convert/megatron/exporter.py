"""export-megatron: a checkpoint of ours (any layout, real or pseudo) as a Megatron-LM ``--save``
directory, torch_dist or legacy, for a Megatron run of a given TP/PP/EP: weights and the args
Megatron needs, and in torch_dist the optimizer state where ours has it (export_optim.py); no
RNG state (the args say so, and Megatron skips it)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.staging import staged_output
from megatron_p2r.checkpoint.tensor_table import tensor_table
from megatron_p2r.config import ConfigError
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.convert.megatron.export_args import (
    CHECKPOINT_VERSION,
    CONTENT_METADATA,
    MegatronLayout,
    flags_to_pass,
    megatron_args,
)
from megatron_p2r.convert.megatron.export_optim import (
    Inverses,
    not_exported,
    optimizer_export,
    scheduler_flags,
    scheduler_state,
    world_size_of,
)
from megatron_p2r.convert.megatron.names import DistNaming, bias_megatron_name
from megatron_p2r.convert.megatron.rules import to_megatron
from megatron_p2r.convert.megatron.source import TRACKER_FILE
from megatron_p2r.convert.megatron.writer import write_dist, write_legacy
from megatron_p2r.convert.reshard import Target, target_config
from megatron_p2r.moe.expert_bias import expert_bias_names

CKPT_FORMATS = ("torch_dist", "torch")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _layout(
    source: SourceCheckpoint, ckpt_format: str, tp: Optional[int], pp: Optional[int], ep: Optional[int]
) -> MegatronLayout:
    """The Megatron layout asked for (unset sizes: the source's), checked as a layout of ours."""
    par = source.cfg.parallel
    layout = MegatronLayout(
        tp or par.tensor_model_parallel_size,
        pp or par.pipeline_model_parallel_size,
        ep or par.expert_model_parallel_size,
        ckpt_format,
    )
    target_config(source.real_cfg, Target(layout.tp, layout.pp, None, layout.ep), delink=False)
    if source.real_cfg.model.num_layers % layout.pp:
        raise ConfigError(
            f"--target-pipeline-parallel-size {layout.pp} does not divide the "
            f"{source.real_cfg.model.num_layers} layers (Megatron splits them evenly)"
        )
    return layout


def _megatron_tensors(
    source: SourceCheckpoint, plan: Inverses, dtype: torch.dtype, progress: bool
) -> Dict[str, torch.Tensor]:
    """Every canonical Megatron tensor, made from our global pieces (names.py, rules.py)."""
    out = {}
    for name, (keys, fn) in tqdm(plan.items(), desc="export-megatron", disable=not progress):
        out[name] = fn([source.read(k).to(torch.float32) for k in keys]).to(dtype).contiguous()
    return out


def _expert_biases(source: SourceCheckpoint) -> Dict[str, torch.Tensor]:
    """Every MoE router's ``expert_bias`` buffer (--moe-router-enable-expert-bias), the decoder's
    and the MTP depths', fp32 as megatron-core keeps it: ours from metadata.json (zero where the
    checkpoint has none)."""
    m = source.real_cfg.model
    zero = torch.zeros(m.num_experts or 0, dtype=torch.float32)
    out = {}
    for name in expert_bias_names(m, range(m.num_layers)):
        bias = source.expert_bias(name)
        out[bias_megatron_name(name)] = zero if bias is None else bias
    return out


def _dist_naming(m) -> DistNaming:
    """Per-layer keys where megatron-core's ``TransformerBlock`` writes them (--moe-layer-freq a
    list or an int N > 1), the local spec's norm names with multi-latent attention."""
    return DistNaming(per_layer=bool(m.num_experts) and m.moe_layer_freq != 1, te_norms=not m.multi_latent_attention)


def export_megatron(
    src: str,
    dst: str,
    *,
    ckpt_format: str = "torch_dist",
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    ep: Optional[int] = None,
    dtype: str = "float32",
    save_optim: bool = True,
    force: bool = False,
    progress: bool = True,
) -> Tuple[str, List[str]]:
    """Write SRC as Megatron-LM's ``--save`` directory DST (the weights and optimizer state are
    held in memory while written: DCP saves one state dict). Returns (iteration directory, notes)."""
    if ckpt_format not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {list(CKPT_FORMATS)}, got {ckpt_format!r}")
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    source = SourceCheckpoint(src)
    cfg = source.real_cfg
    layout = _layout(source, ckpt_format, tp, pp, ep)
    iteration = int(source.meta["iteration"])
    skipped = "--no-save-optim" if not save_optim else not_exported(source, ckpt_format, dtype)
    args = megatron_args(
        cfg,
        layout,
        iteration=iteration,
        consumed_samples=int(source.meta["consumed_samples"]),
        dtype=dtype,
        optimizer=skipped is None,
    )
    plan = to_megatron(list(tensor_table(cfg)), cfg.model)
    optim = None if skipped else optimizer_export(source, plan, dtype, layout.ep)
    tensors = _megatron_tensors(source, plan, EXPORT_DTYPES[dtype], progress)
    tensors.update(_expert_biases(source))
    header = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
    }
    name = f"iter_{iteration:07d}"
    with staged_output(src, source.iter_dir, dst, force) as tmp:
        iter_dir = os.path.join(tmp, name)
        os.makedirs(iter_dir)
        if ckpt_format == "torch_dist":
            common = {**header, "content_metadata": dict(CONTENT_METADATA)}
            if optim:
                common.update(optimizer=optim.optimizer, opt_param_scheduler=optim.scheduler)
            write_dist(iter_dir, tensors, common, optim.tensors if optim else None, _dist_naming(cfg.model))
        else:
            m = cfg.model
            write_legacy(iter_dir, tensors, header, layout, m.num_layers, m.num_experts or 0, m.gated_linear_unit)
        write_text_atomic(os.path.join(tmp, TRACKER_FILE), str(iteration))
    return os.path.join(dst, name), _notes(source, layout, args, skipped)


def _notes(source: SourceCheckpoint, layout: MegatronLayout, args, skipped: Optional[str]) -> List[str]:
    m = source.real_cfg.model
    notes = [
        f"for Megatron-LM with --tensor-model-parallel-size {layout.tp} --pipeline-model-parallel-size "
        f"{layout.pp}"
        + (f" --expert-model-parallel-size {layout.ep}" if m.num_experts else "")
        + f" --ckpt-format {layout.ckpt_format} (the model flags are in the checkpoint's args: "
        "--use-checkpoint-args reads them)"
    ]
    extra = flags_to_pass(args)
    if extra:
        notes.append(f"with --use-checkpoint-args also pass {' '.join(extra)} (flags it does not restore)")
    if source.pseudo:
        notes.append(f"delinked on the fly from the pseudo phase (layer -> module {source.layer_keys})")
    if layout.ckpt_format == "torch":
        notes.append(f"weights only ({skipped}): load with --finetune, or --no-load-optim --no-load-rng")
    elif skipped:
        notes.append(
            f"weights only ({skipped}): the args say no_save_optim and no_save_rng, so Megatron loads no "
            "optimizer or RNG state"
        )
    else:
        world = world_size_of(source)
        saved = scheduler_state(source.real_cfg, 0, world)
        notes.append(
            f"optimizer: Adam's moments and step {'and fp32 mains (a --bf16 run) ' if args.bf16 else ''}for megatron-core's "
            f"non-distributed optimizer (no --use-distributed-optimizer), iteration {args.iteration}, "
            f"{args.consumed_train_samples} consumed samples; no RNG state (the args say no_save_rng)"
        )
        notes.append(
            f"Megatron-LM checks the saved LR and weight-decay schedule on resume and stops at a difference: "
            f"pass {' '.join(scheduler_flags(source.real_cfg, world))} (warm-up {saved['lr_warmup_steps']}, "
            f"decay {saved['lr_decay_steps']} and weight-decay length {saved['wd_incr_steps']} samples), or "
            "--override-opt-param-scheduler to keep your own flags' schedule at this position"
        )
    return notes
