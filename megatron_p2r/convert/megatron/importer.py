"""import-megatron: a Megatron-LM GPT / Llama / Mixtral checkpoint (torch_dist or legacy, any
TP/PP/EP) as a checkpoint of ours (real phase, iteration 0) in any layout: the weights, and
where the checkpoint holds Adam's state (torch_dist optimizer keys or distributed-optimizer
buckets, the legacy layout's state lists or distrib_optim.pt), its moments, step and fp32 main
weights; every tensor is planned and its shape checked before anything is written, then
streamed one piece at a time."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.imported import MODEL_YAML, RunPosition, write_imported
from megatron_p2r.convert.megatron.args import SavedArgs, model_values, vocab_values
from megatron_p2r.convert.megatron.names import OUTPUT_LAYER, bias_megatron_name, is_buffer
from megatron_p2r.convert.megatron.rules import megatron_name, megatron_shape, transform
from megatron_p2r.convert.megatron.source import MegatronCheckpoint, open_megatron
from megatron_p2r.convert.reshard import Target, target_config
from megatron_p2r.checkpoint.tensor_table import TensorInfo, tensor_table
from megatron_p2r.config import Config, DataConfig, ModelConfig
from megatron_p2r.moe.expert_bias import expert_bias_names

Plan = Dict[str, Tuple[str, Callable[[torch.Tensor], torch.Tensor]]]
MOMENTS = ("exp_avg", "exp_avg_sq")


def import_megatron(
    src: str, dst: str, target: Target, *, force: bool = False, progress: bool = True
) -> Tuple[str, List[str]]:
    """Write the Megatron-LM checkpoint SRC as a checkpoint of ours in the ``target`` layout (unset
    sizes: 1). Returns (iteration directory, notes)."""
    source = open_megatron(src)
    a = source.args
    values, zero_centered, notes = model_values(a)
    cfg, vocab_note = _imported_config(values, a, target)
    table = tensor_table(cfg)
    biases = _expert_biases(source, cfg.model)
    buffers = {n for n in source.names if is_buffer(n)}
    plan = _plan(source, table, cfg.model, zero_centered, a.required("padded_vocab_size"), buffers)
    flags, tokenizer_note = _tokenizer_flags(a)
    history = {
        "op": "import-megatron",
        "source": os.path.abspath(source.iter_dir),
        "source_layout": f"megatron {source.format}: TP={a.tp} PP={a.pp} EP={a.ep}",
    }
    moments = _moments_plan(source, plan, cfg.model)
    kinds = ("model",) + (MOMENTS + ("step",) if moments else ())
    where = _run_position(source) if moments else RunPosition()
    out = write_imported(
        src,
        source.iter_dir,
        dst,
        cfg,
        table,
        _producer(source, plan, moments),
        history=history,
        force=force,
        progress=progress,
        extras=lambda staging: flags,
        kinds=kinds,
        position=where,
        expert_bias={ours: source.read(name).tolist() for name, ours in biases.items()} or None,
    )
    yaml_path = os.path.join(dst, MODEL_YAML)
    notes += [n for n in (vocab_note, tokenizer_note) if n]
    if biases:
        notes.append(f"expert biases: Megatron's routers' expert_bias of {len(biases)} MoE layers, exact")
    if moments:
        mains = "its fp32 main weights, " if source.optimizer["main"] else ""
        notes.append(
            f"optimizer: Adam's moments, {mains}step {source.adam_step:g} imported, and Megatron's iteration "
            f"{where.iteration}, {where.consumed_samples} consumed samples and LR-schedule position "
            f"{where.scheduler_steps} (--load continues them with your --lr and schedule flags); "
            "Megatron's RNG states are not"
        )
    else:
        why = f" ({source.optimizer_not_read})" if source.optimizer_not_read else ""
        notes.append(
            f"weights only: Megatron's optimizer state, iteration and RNG states are not imported{why} (a "
            "fresh optimizer starts, as with --finetune)"
        )
    finetune = "" if moments else " --finetune"
    notes.append(
        f"model and layout flags in {yaml_path}: train with --config {yaml_path} --load {dst}"
        f"{finetune} plus data and training flags"
    )
    return out, notes


def _run_position(source: MegatronCheckpoint) -> RunPosition:
    """Megatron's iteration, ``args.consumed_train_samples`` and ``opt_param_scheduler.num_steps``
    (samples, as its train loop counts them) from the file that holds the args."""
    saved, where = source.saved, source.saved_path
    scheduler = saved.get("opt_param_scheduler")
    values = {
        "iteration": saved.get("iteration"),
        "consumed_train_samples": source.args.get("consumed_train_samples"),
        "opt_param_scheduler.num_steps": scheduler.get("num_steps") if isinstance(scheduler, dict) else None,
    }
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"{where}: {name} is {value!r}, expected an integer >= 0 (the saved run's position, "
                "needed to continue it with its optimizer state)"
            )
    return RunPosition(*values.values())


def _imported_config(values: dict, a: SavedArgs, target: Target) -> Tuple[Config, Optional[str]]:
    """Our config for the Megatron model in the ``target`` layout, and a note if the vocabulary
    gets more padding rows than Megatron's."""
    tp = target.tensor_parallel_size or 1
    vocab, divisor, note = vocab_values(a, tp)
    values.update(vocab_size=vocab, make_vocab_size_divisible_by=divisor)
    base = Config.from_dict({"model": values})
    cfg = target_config(
        base,
        Target(tp, target.pipeline_parallel_size or 1, target.pipeline_layer_split, target.expert_parallel_size),
        delink=False,
    )
    return cfg, note


def _expert_biases(source: MegatronCheckpoint, m: ModelConfig) -> Dict[str, str]:
    """Megatron's router buffers ``expert_bias`` (--moe-router-enable-expert-bias), the decoder's
    MoE layers' and the MTP depths': {Megatron's name: ours} for metadata.json's ``expert_bias``
    (checkpoint/expert_bias.py); every router's must be there."""
    out = {}
    for ours in expert_bias_names(m, range(m.num_layers)):
        name = bias_megatron_name(ours)
        if name not in source.names:
            parts = ours.split(".")
            router = f"layer {parts[1]}'s" if parts[0] == "layers" else f"MTP depth {parts[2]}'s"
            raise CheckpointError(
                f"{source.iter_dir}: the args say --moe-router-enable-expert-bias, but the checkpoint has no "
                f"expert_bias of {router} router"
            )
        out[name] = ours
    return out


def _plan(
    source: MegatronCheckpoint,
    table: Dict[str, TensorInfo],
    m: ModelConfig,
    zero_centered: bool,
    vocab_rows: int,
    not_tensors: Set[str] = frozenset(),
) -> Plan:
    """Our piece -> (Megatron tensor, transform), every shape checked, and every Megatron tensor
    used (or in ``not_tensors``, the expert biases, which go elsewhere): none is silently dropped."""
    plan: Plan = {}
    for key, info in table.items():
        name = megatron_name(key)
        if name not in source.names:
            raise CheckpointError(f"{source.iter_dir}: the checkpoint has no tensor {name} (needed for our {key})")
        want = megatron_shape(key, info.shape, m, vocab_rows)
        if source.shape(name) != want:
            raise CheckpointError(
                f"{source.location(name)}: {name} has shape {list(source.shape(name))}, the saved "
                f"args imply {list(want)}"
            )
        plan[key] = (name, transform(key, m, zero_centered))
    used = {name for name, _ in plan.values()} | set(not_tensors)
    if not m.untie_embeddings_and_output_weights:
        used.add(OUTPUT_LAYER)  # the last stage's replica of the tied embedding (legacy layout, PP > 1)
    unused = sorted(set(source.names) - used)
    if unused:
        raise CheckpointError(
            f"{source.location(unused[0])}: {len(unused)} tensors have no place in our model, "
            f"e.g. {unused[0]}; refusing to drop weights"
        )
    return plan


def _moments_plan(source: MegatronCheckpoint, plan: Plan, m: ModelConfig) -> Optional[Plan]:
    """Our piece -> (Megatron tensor, transform of its Adam moments) when the checkpoint holds
    Adam's state (every weight's moments, each of its weight's shape); None: weights only. The
    moments take the weight's reordering, not its value shifts (``--apply-layernorm-1p``)."""
    if source.adam_step is None or not any(source.optimizer[k] for k in MOMENTS):
        return None
    for name, _ in plan.values():
        for kind in MOMENTS + (("main",) if source.optimizer["main"] else ()):
            if name not in source.optimizer[kind]:
                raise CheckpointError(f"{source.location(name)}: the optimizer state has no {kind} of {name}")
            if source.shape(name, kind) != source.shape(name):
                raise CheckpointError(
                    f"{source.location(name)}: the {kind} of {name} has shape "
                    f"{list(source.shape(name, kind))}, the weight {list(source.shape(name))}"
                )
    return {key: (name, transform(key, m, False)) for key, (name, _) in plan.items()}


def _producer(source: MegatronCheckpoint, plan: Plan, moments: Optional[Plan]):
    """(our piece, kind) -> its tensor: the weight (the fp32 main when saved), a moment, or the step."""

    def produce(info: TensorInfo, kind: str) -> torch.Tensor:
        if kind == "step":
            return torch.tensor(source.adam_step, dtype=torch.float32).reshape(())
        name, fn = (plan if kind == "model" else moments)[info.key]
        if kind == "model" and not (moments and source.optimizer["main"]):
            tensor = source.read(name)
        else:
            tensor = source.read(name, "main" if kind == "model" else kind)
        return fn(tensor.to(torch.float32)).contiguous()

    return produce


def _tokenizer_flags(a: SavedArgs) -> Tuple[dict, str]:
    """Megatron's tokenizer flags for model.yaml when this package has that tokenizer and its files
    are here; otherwise empty, and a note saying what to pass."""
    kind = a.get("tokenizer_type")
    if kind is None:
        return {}, ""
    paths = {k: a.get(k) for k in ("tokenizer_model", "vocab_file", "merge_file") if a.get(k)}
    given = " ".join([f"--tokenizer-type {kind}"] + [f"--{k.replace('_', '-')} {v}" for k, v in paths.items()])
    choices = {f.name: f for f in dataclasses.fields(DataConfig)}["tokenizer_type"].metadata["choices"]
    if kind not in choices:
        return {}, f"tokenizer: Megatron's {given} has no equivalent here; pass one with the same vocabulary"
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        return {}, f"tokenizer: Megatron's {given}; {missing[0]} is not here, pass the files with your data flags"
    return {"tokenizer_type": kind, **paths, **_tiktoken_flags(a, kind)}, f"tokenizer: {given} (in model.yaml)"


def _tiktoken_flags(a: SavedArgs, kind: str) -> dict:
    """TikTokenizer's layout as Megatron saved it (its special tokens under the current flag name,
    or the deprecated --tiktoken-special-tokens)."""
    if kind != "TikTokenizer":
        return {}
    specials = a.get("tokenizer_special_tokens") or a.get("tiktoken_special_tokens")
    values = {
        "tiktoken_pattern": a.get("tiktoken_pattern"),
        "tiktoken_special_tokens": specials,
        "tiktoken_num_special_tokens": a.get("tiktoken_num_special_tokens"),
    }
    return {key: value for key, value in values.items() if value is not None}
