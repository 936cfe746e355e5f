"""metadata.json: what it holds, written once per checkpoint, and checked field by field on read
so that a hand-edited or foreign file fails here, naming the field."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.naming import FORMAT_VERSION, METADATA_FILE, OPTIM_KINDS
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo
from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan

REQUIRED_FIELDS = ("format_version", "iteration", "consumed_samples", "config", "layout", "p2r", "optimizer",
                   "tensors", "files")
_FIELD_TYPES = {"iteration": int, "consumed_samples": int, "config": dict, "layout": dict, "p2r": dict,
                "optimizer": bool, "tensors": dict, "files": dict, "scheduler": dict, "scaler": dict}


def _p2r_json(cfg: Config) -> dict:
    plan = ParallelPlan.model_parallel(cfg)
    return {"phase": plan.phase, "share_pattern": plan.share_pattern, "layer_module_keys": list(plan.layer_keys)}


def build_metadata(cfg: Config, table: Dict[str, TensorInfo], *, iteration: int, consumed_samples: int,
                   optimizer: bool, scheduler: dict, scaler: dict, files: Dict[str, int],
                   rng: Optional[dict], history: List[dict]) -> dict:
    """The metadata.json contents (shared by training saves and the converters)."""
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "config": cfg.to_dict(), "layout": ShardLayout.of(cfg).to_json(), "p2r": _p2r_json(cfg),
            "optimizer": optimizer, "optimizer_kinds": list(OPTIM_KINDS) if optimizer else [],
            "scheduler": scheduler, "scaler": scaler, "rng": rng, "history": history,
            "files": files, "tensors": {k: v.to_json() for k, v in table.items()}}


def write_metadata(iter_dir: str, metadata: dict) -> None:
    path = os.path.join(iter_dir, METADATA_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(metadata, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def read_metadata(iter_dir: str) -> dict:
    """Parse and check ``metadata.json``: version, required fields, a table consistent with its config."""
    path = os.path.join(iter_dir, METADATA_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown format_version {version!r}; this code reads version {FORMAT_VERSION}")
    for field in REQUIRED_FIELDS:
        if field not in meta:
            raise CheckpointError(f"{path}: required field {field!r} is missing")
    _check_field_types(meta, path)
    return meta


def _check_field_types(meta: dict, path: str) -> None:
    """Types of the fields loading relies on, so a hand-edited metadata.json fails here, by name."""
    def bad(field, expected, value):
        return CheckpointError(f"{path}: field {field!r} must be {expected}, found {json.dumps(value)[:80]}")

    for field, kind in _FIELD_TYPES.items():
        value = meta.get(field)
        if field in meta and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise bad(field, f"a JSON {'integer' if kind is int else kind.__name__.replace('dict', 'object')}", value)
    for field in ("iteration", "consumed_samples"):
        if meta[field] < 0:
            raise bad(field, ">= 0", meta[field])
    for key, kind in (("phase", str), ("share_pattern", str), ("layer_module_keys", list)):
        if not isinstance(meta["p2r"].get(key), kind):
            raise bad(f"p2r.{key}", f"a JSON {kind.__name__.replace('str', 'string')}", meta["p2r"].get(key))
    for section, values in meta["config"].items():
        if not isinstance(values, dict):
            raise bad(f"config.{section}", "a JSON object", values)
    for name, size in meta["files"].items():
        if not isinstance(size, int) or size < 0:
            raise bad(f"files.{name}", "a size in bytes", size)
    rng = meta.get("rng")
    if rng is not None and not (isinstance(rng, dict) and all(isinstance(rng.get(k), int) and rng[k] >= 1
                                                              for k in ("world_size", "tp", "pp", "dp"))):
        raise bad("rng", "null or an object with integer world_size, tp, pp, dp", rng)


def metadata_table(meta: dict) -> Dict[str, TensorInfo]:
    return {k: TensorInfo.from_json(k, v) for k, v in meta["tensors"].items()}


def metadata_config(meta: dict) -> Config:
    try:
        return Config.from_dict(meta["config"])
    except (TypeError, AttributeError) as exc:
        raise CheckpointError(f"{METADATA_FILE}: field 'config' does not describe this code's Config ({exc})") from None


def kinds_of(meta: dict) -> Tuple[str, ...]:
    """The tensor kinds each piece is stored as: the weights, and the AdamW state when saved."""
    return ("model",) + (OPTIM_KINDS if meta["optimizer"] else ())
