"""A checkpoint of ours made from another format (import-hf, import-megatron): real phase,
weights (and Adam's moments and step where the source has them; then also the source's
iteration, consumed samples and LR-schedule position, else iteration 0 and a fresh schedule; a
fresh loss scale), streamed piece by
piece into the staging directory, verified, with ``model.yaml`` (the model and layout flags,
for ``--config``) and the latest file; published only when complete."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Optional, Sequence

import yaml

from megatron_p2r.checkpoint.atomic import write_text_atomic
from megatron_p2r.checkpoint.integrity import verify
from megatron_p2r.checkpoint.metadata import build_metadata, write_metadata
from megatron_p2r.checkpoint.naming import LATEST_FILE, iteration_dir_name
from megatron_p2r.convert.pieces import Producer, write_pieces
from megatron_p2r.checkpoint.staging import staged_output
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo
from megatron_p2r.config import Config
from megatron_p2r.optim.grad_scaler import LossScaler

MODEL_YAML = "model.yaml"


@dataclasses.dataclass(frozen=True)
class RunPosition:
    """Where the source run stood: its iteration, the samples it consumed, and its LR schedule's
    position (in samples, as Megatron-LM and this framework count it)."""

    iteration: int = 0
    consumed_samples: int = 0
    scheduler_steps: int = 0


def write_imported(
    src: str,
    src_iter: str,
    dst: str,
    cfg: Config,
    table: Dict[str, TensorInfo],
    produce: Producer,
    *,
    history: dict,
    force: bool,
    progress: bool,
    extras: Callable[[str], dict] = lambda staging: {},
    kinds: Sequence[str] = ("model",),
    position: RunPosition = RunPosition(),
    expert_bias: Optional[Dict[str, List[float]]] = None,
) -> str:
    """Write every piece of ``table`` (each of ``kinds``, as ``produce`` makes it) as DST;
    ``extras(staging)`` may add files beside the checkpoint and returns the data flags model.yaml
    gets; ``expert_bias``: the routers' biases (``checkpoint/expert_bias.py``). Returns the
    iteration directory."""
    layout = ShardLayout.of(cfg)
    with staged_output(src, src_iter, dst, force) as tmp:
        out_iter = os.path.join(tmp, iteration_dir_name(position.iteration))
        os.makedirs(out_iter)
        checksums = write_pieces(out_iter, table, layout, kinds, produce, progress=progress, desc=history["op"])
        files = {f: os.path.getsize(os.path.join(out_iter, f)) for f in layout.files()}
        meta = build_metadata(
            cfg,
            table,
            iteration=position.iteration,
            consumed_samples=position.consumed_samples,
            optimizer=len(kinds) > 1,
            scheduler={"num_steps": position.scheduler_steps, "updates": position.iteration},
            scaler=LossScaler(cfg.train).state_dict(),
            files=files,
            rng=None,
            history=[history],
            checksums=checksums,
            expert_bias=expert_bias,
        )
        write_metadata(out_iter, meta)
        verify(out_iter, meta, expected_params=sum(i.numel for i in table.values()))
        write_model_yaml(os.path.join(tmp, MODEL_YAML), cfg, extras(tmp))
        write_text_atomic(os.path.join(tmp, LATEST_FILE), str(position.iteration))
    return os.path.join(dst, iteration_dir_name(position.iteration))


def write_model_yaml(path: str, cfg: Config, data_flags: dict) -> None:
    """The model and layout flags of the imported checkpoint, for ``--config`` (flat, dashed keys)."""
    values = {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None}
    p = cfg.parallel
    values.update(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        **data_flags,
    )
    if p.pipeline_layer_split:
        values["pipeline_layer_split"] = p.pipeline_layer_split
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump({k.replace("_", "-"): v for k, v in values.items()}, fh, sort_keys=False)
