"""metadata.json: what it holds, written once per checkpoint, and checked against a schema on read
(every field's type and range, the config's values through the config's own range tables, and a
config no bigger than the tensors and files listed) so that a hand-edited, foreign or crafted
file fails here, naming the field, instead of deep inside a loader or in a runaway allocation.

The file carries the CRC-32 of its own bytes (``metadata_crc32``, its last field: every byte
before it is covered), as the shards carry their tensors' in ``crc32``: a changed byte of it is
refused on load, conversion and ``inspect``. A file without it was written before it was and is
read as it was then (``checksum_coverage`` says what is and is not covered)."""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.expert_bias import FIELD as EXPERT_BIAS
from megatron_p2r.checkpoint.expert_bias import valid_field as valid_expert_biases
from megatron_p2r.checkpoint.naming import FORMAT_VERSION, METADATA_FILE
from megatron_p2r.checkpoint.safetensors_io import TORCH_DTYPE
from megatron_p2r.checkpoint.tensor_table import ShardLayout, TensorInfo
from megatron_p2r.config import Config, ConfigError, check_values
from megatron_p2r.files import JSON_LIMIT, parse_json, read_bounded
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.optim.optimizer import OPTIMIZER_KINDS

# Written since --moe-layer-freq took Megatron-LM's meaning; before, an integer N made layers N-1, 2N-1, ... MoE.
MOE_LAYERS_FROM_0 = "moe_layer_freq_from_layer_0"


REQUIRED_FIELDS = (
    "format_version",
    "iteration",
    "consumed_samples",
    "config",
    "layout",
    "p2r",
    "optimizer",
    "tensors",
    "files",
)


def _p2r_json(cfg: Config) -> dict:
    plan = ParallelPlan.model_parallel(cfg)
    return {"phase": plan.phase, "share_pattern": plan.share_pattern, "layer_module_keys": list(plan.layer_keys)}


def build_metadata(
    cfg: Config,
    table: Dict[str, TensorInfo],
    *,
    iteration: int,
    consumed_samples: int,
    optimizer: bool,
    scheduler: dict,
    scaler: dict,
    files: Dict[str, int],
    rng: Optional[dict],
    history: List[dict],
    checksums: Dict[str, Dict[str, int]],
    parts: Optional[Dict[str, List[str]]] = None,
    optimizer_kinds: Sequence[str] = OPTIMIZER_KINDS["adam"],
    expert_bias: Optional[Dict[str, List[float]]] = None,
) -> dict:
    """The metadata.json contents (shared by training saves and the converters); ``checksums``:
    file -> tensor entry -> CRC-32 of its bytes (``ShardWriter.checksums``); ``parts``: the part
    files of each shard written in parts (``parts.py``), whose names ``files`` lists instead;
    ``expert_bias``: the routers' biases (``expert_bias.py``)."""
    return {
        **({"parts": parts} if parts else {}),
        **({EXPERT_BIAS: expert_bias} if expert_bias else {}),
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "config": cfg.to_dict(),
        "layout": ShardLayout.of(cfg).to_json(),
        "p2r": _p2r_json(cfg),
        "optimizer": optimizer,
        "optimizer_kinds": list(optimizer_kinds) if optimizer else [],
        "scheduler": scheduler,
        "scaler": scaler,
        "rng": rng,
        "history": history,
        "files": files,
        "crc32": checksums,
        "tensors": {k: v.to_json() for k, v in table.items()},
        "factored_statistics": True,
        MOE_LAYERS_FROM_0: True,
    }


SELF_CHECKSUM = "metadata_crc32"
# the end of every metadata.json written since: its checksum, of every byte before this match
_TRAILER = re.compile(rb',\n "' + SELF_CHECKSUM.encode() + rb'": ([0-9]{1,10})\n}\n\Z')


def write_metadata(iter_dir: str, metadata: dict) -> None:
    """Write ``metadata`` (without any checksum of a file it was read from), then the CRC-32 of
    those bytes as the last field."""
    body = json.dumps({k: v for k, v in metadata.items() if k != SELF_CHECKSUM}, indent=1)
    body = body[:-2]  # without its closing "\n}": the checksum field follows the last one
    path = os.path.join(iter_dir, METADATA_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f'{body},\n "{SELF_CHECKSUM}": {zlib.crc32(body.encode())}\n}}\n')
        fh.flush()
        os.fsync(fh.fileno())


def read_metadata(iter_dir: str) -> dict:
    """Parse ``metadata.json`` and check it against its schema (``_SCHEMA``): version, required
    fields, the type and range of every field loading or converting reads."""
    path = os.path.join(iter_dir, METADATA_FILE)
    try:
        data = read_bounded(path, CheckpointError, JSON_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    meta = parse_json(data, path, CheckpointError)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    if SELF_CHECKSUM in meta:
        _check_own_checksum(data, path)
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown format_version {version!r}; this code reads version {FORMAT_VERSION}")
    for field in REQUIRED_FIELDS:
        if field not in meta:
            raise CheckpointError(f"{path}: required field {field!r} is missing")
    _check_schema(meta, path)
    return meta


def _check_own_checksum(data: bytes, path: str) -> None:
    """The file's bytes before its last field have the CRC-32 that field records."""
    trailer = _TRAILER.search(data)
    if trailer is None:
        raise CheckpointError(
            f"{path}: field {SELF_CHECKSUM!r} is not the file's last line as written at save: "
            "the file was rewritten since, so none of its fields can be trusted (restore it, "
            "or load another iteration)"
        )
    found, recorded = zlib.crc32(data[: trailer.start()]), int(trailer[1])
    if found != recorded:
        raise CheckpointError(
            f"{path}: corrupt or edited: its bytes have CRC-32 {found:08x}, its field "
            f"{SELF_CHECKSUM!r} records {recorded:08x}; none of its fields can be trusted "
            "(restore it, or load another iteration)"
        )


def checksum_coverage(meta: dict) -> str:
    """What the checksums of a checkpoint cover, in words (``inspect --verify``, a load's note)."""
    own, tensors = SELF_CHECKSUM in meta, meta.get("crc32") is not None
    if own and tensors:
        return "every CRC-32 matches metadata.json, whose own bytes match its metadata_crc32"
    if tensors:
        return (
            "every CRC-32 matches metadata.json; metadata.json itself has no checksum (written before "
            "metadata_crc32 was): its fields are checked against the schema and the shards' headers only"
        )
    if own:
        return "metadata.json's own bytes match its metadata_crc32; no tensor checksums recorded: sizes and headers checked"
    return (
        "no checksums recorded (a checkpoint written before they were): sizes and headers checked, "
        "metadata.json itself not checksummed"
    )


# The largest count (iteration, samples, steps) a checkpoint's metadata accepts; the converter
# refuses options that would write a larger one.
MAX_COUNT = 2**62


def _int(low: int = 0, high: int = MAX_COUNT):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _int_list(v) -> bool:
    return isinstance(v, list) and all(_int()(x) for x in v)


def _optional(check):
    return lambda v: v is None or check(v)


def _object(**fields):
    """An object whose listed fields pass their checks (other fields are allowed)."""
    return lambda v: isinstance(v, dict) and all(k in v and ok(v[k]) for k, ok in fields.items())


# field -> (check, what it must be): everything loading, converting or inspecting reads.
_SCHEMA = {
    "iteration": (_int(), "an integer >= 0"),
    "consumed_samples": (_int(), "an integer >= 0"),
    "config": (
        lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()),
        "an object of config sections (objects)",
    ),
    "layout": (lambda v: isinstance(v, dict), "a JSON object"),
    "p2r": (
        _object(
            phase=lambda v: v in ("pseudo", "real"),
            share_pattern=lambda v: isinstance(v, str),
            layer_module_keys=_int_list,
        ),
        "an object with phase pseudo|real, a share_pattern string and layer_module_keys integers",
    ),
    "optimizer": (lambda v: isinstance(v, bool), "true or false"),
    "optimizer_kinds": (
        lambda v: isinstance(v, list) and (not v or v in [list(k) for k in OPTIMIZER_KINDS.values()]),
        "the state entries of one optimizer: " + " or ".join(str(list(k)) for k in OPTIMIZER_KINDS.values()),
    ),
    "tensors": (lambda v: isinstance(v, dict), "a JSON object"),
    "factored_statistics": (lambda v: v is True, "true (Adafactor's statistics stored factored)"),
    MOE_LAYERS_FROM_0: (lambda v: v is True, "true (an integer --moe-layer-freq N counts layers 0, N, ...)"),
    "files": (
        lambda v: isinstance(v, dict) and all(_int()(x) for x in v.values()),
        "an object of file names to sizes in bytes",
    ),
    "parts": (
        lambda v: (
            isinstance(v, dict) and all(isinstance(p, list) and all(isinstance(x, str) for x in p) for p in v.values())
        ),
        "an object of shard file names to lists of part file names",
    ),
    "scheduler": (
        lambda v: (
            _object(num_steps=_int())(v)
            and _optional(_int())(v.get("updates"))
            and _optional(_object(start=_int(), iters=_int(1)))(v.get("rewarmup"))
        ),
        "an object with an integer num_steps >= 0 (samples), optional integer updates >= 0 and "
        "rewarmup null or {start >= 0, iters >= 1}",
    ),
    "scaler": (
        _object(scale=lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, good_steps=_int()),
        "an object with a positive scale and an integer good_steps >= 0",
    ),
    "rng": (
        _optional(_object(world_size=_int(1, 2**24), tp=_int(1, 2**24), pp=_int(1, 2**24), dp=_int(1, 2**24))),
        "null or an object with integer world_size, tp, pp, dp >= 1",
    ),
    "crc32": (
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(f, dict) and all(_int(0, 2**32 - 1)(c) for c in f.values()) for f in v.values())
        ),
        "an object of file names to objects of tensor names to CRC-32 values (0 <= c < 2^32)",
    ),
    SELF_CHECKSUM: (_int(0, 2**32 - 1), "a CRC-32 (0 <= c < 2^32)"),
    EXPERT_BIAS: (valid_expert_biases, "an object of expert-bias names to lists of numbers"),
    "history": (
        lambda v: (
            isinstance(v, list)
            and all(_object(op=lambda x: isinstance(x, str), source=lambda x: isinstance(x, str))(h) for h in v)
        ),
        "a list of objects with op and source strings",
    ),
}
_TENSOR_FIELDS = {
    "param": lambda v: isinstance(v, str),
    "shape": lambda v: _int_list(v) and len(v) <= 8,
    "dtype": lambda v: isinstance(v, str) and v in TORCH_DTYPE,
    "tp_dim": _optional(_int(0, 7)),
    "ep_dim": _optional(_int(0, 0)),
    "expert": _optional(_int()),
    "stage": _int(),
    "module_key": _optional(_int()),
    "layers": _int_list,
}
# attention projections only: dim 0 as blocks of heads (layout.tensor_specs.HeadRows)
_ROWS = _optional(
    _object(
        groups=_int(1, 2**24),
        head_dim=_int(1, 2**24),
        per_group=lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    )
)


def _check_schema(meta: dict, path: str) -> None:
    """Each field of ``_SCHEMA`` present in ``meta`` is what it must be; each tensors entry too."""
    for field, (ok, what) in _SCHEMA.items():
        if field in meta and not ok(meta[field]):
            raise CheckpointError(f"{path}: field {field!r} must be {what}, found {json.dumps(meta[field])[:80]}")
    if meta.get("parts") and meta.get("crc32") is None:
        raise CheckpointError(
            f"{path}: field 'crc32' is missing, but a checkpoint saved in parts (field 'parts') "
            "always records its checksums"
        )
    rng = meta.get("rng")
    if rng and rng["world_size"] != rng["tp"] * rng["pp"] * rng["dp"] * rng.get("cp", 1):
        raise CheckpointError(f"{path}: field 'rng' has world_size {rng['world_size']} != tp x pp x dp x cp")
    for key, entry in meta["tensors"].items():
        bad = [
            f for f, ok in _TENSOR_FIELDS.items() if not isinstance(entry, dict) or f not in entry or not ok(entry[f])
        ] or ([] if _ROWS(entry.get("rows")) else ["rows"])
        if bad or (entry["tp_dim"] is not None and entry["tp_dim"] >= len(entry["shape"])):
            raise CheckpointError(
                f"{path}: tensors[{key!r}] has no valid {(bad or ['tp_dim'])[0]!r}: {json.dumps(entry)[:120]}"
            )


def metadata_table(meta: dict) -> Dict[str, TensorInfo]:
    return {k: TensorInfo.from_json(k, v) for k, v in meta["tensors"].items()}


def _upgraded(config: dict, meta: Optional[dict] = None) -> dict:
    """A saved config as this code reads it, for what older code wrote otherwise: before
    ``MOE_LAYERS_FROM_0`` (in ``meta``) an integer --moe-layer-freq N meant layers N-1, 2N-1, ...
    (read as the list of them); before the router had a bias (no ``moe_router_bias`` field; every
    field is saved since) the router had none."""
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return config
    model = {"moe_router_bias": False, **model}
    freq, layers = model.get("moe_layer_freq"), model.get("num_layers")
    older_rule = MOE_LAYERS_FROM_0 not in (meta or {}) and model.get("num_experts")
    if older_rule and type(freq) is int and freq > 1 and type(layers) is int and 0 < layers <= 1 << 16:
        model["moe_layer_freq"] = [int((i + 1) % freq == 0) for i in range(layers)]  # bad values: the range check
    return {**config, "model": model}


def metadata_config(meta: dict) -> Config:
    """The checkpoint's Config: every value of its type and range, the model and its split
    consistent, and no bigger than the tensors and files the metadata lists (so an edited config
    cannot make a reader build a table of a billion files)."""
    try:
        cfg = Config.from_dict(_upgraded(meta["config"], meta))
        check_values(cfg)
        m, p = cfg.model, cfg.parallel
        m.check()
        p.check(m.num_layers)
        m.check_split(p.tensor_model_parallel_size, p.expert_model_parallel_size)
        cfg.p2r.check(m.num_layers)
        cfg.offload.check(m.num_layers)
    except (TypeError, AttributeError) as exc:
        raise CheckpointError(f"{METADATA_FILE}: field 'config' does not describe this code's Config ({exc})") from None
    except ConfigError as exc:
        raise CheckpointError(f"{METADATA_FILE}: field 'config' is not a valid configuration: {exc}") from None
    if m.vocab_size is None:
        raise CheckpointError(f"{METADATA_FILE}: field 'config' has no model.vocab_size")
    _check_size(cfg, meta)
    _check_placement(cfg, meta)
    return cfg


def _check_size(cfg: Config, meta: dict) -> None:
    m = cfg.model
    _check_files_field(cfg, meta)
    keys = meta["p2r"]["layer_module_keys"]
    if len(keys) != m.num_layers:
        raise CheckpointError(
            f"{METADATA_FILE}: p2r.layer_module_keys has {len(keys)} entries for {m.num_layers} layers"
        )
    modules = set(keys)
    implied = 4 * len(modules) + 2 * (m.num_experts or 0) * sum(1 for k in modules if m.is_moe_layer(k))
    if implied > len(meta["tensors"]):
        raise CheckpointError(
            f"{METADATA_FILE}: the config implies at least {implied} tensors, field 'tensors' "
            f"lists {len(meta['tensors'])}"
        )
    if tuple(keys) != ParallelPlan.model_parallel(cfg).layer_keys:
        raise CheckpointError(
            f"{METADATA_FILE}: p2r.layer_module_keys does not follow the config's share pattern "
            f"{cfg.p2r.share_pattern!r}"
        )


def _check_files_field(cfg: Config, meta: dict) -> None:
    """'files' lists each shard of the config's layout, or instead the part files 'parts' gives it."""
    shards, parts = ShardLayout.of(cfg).files(), meta.get("parts") or {}
    odd = sorted(set(parts) - set(shards))
    if odd:
        raise CheckpointError(
            f"{METADATA_FILE}: field 'parts' names {odd[0]!r}, which is not a shard file of the config's layout"
        )
    for shard, names in parts.items():
        stem = shard.split(".")[0] + "."
        if any(not n.startswith(stem) or "/" in n or os.sep in n for n in names):
            raise CheckpointError(f"{METADATA_FILE}: parts[{shard!r}] must list files named {stem}*, found {names}")
    expected = {f for s in shards for f in parts.get(s, [s])}
    if len(expected) != sum(len(parts.get(s, [s])) for s in shards) or set(meta["files"]) != expected:
        unexpected = sorted(set(meta["files"]) ^ expected) or ["a part listed twice"]
        raise CheckpointError(
            f"{METADATA_FILE}: field 'files' does not list the config's layout's "
            f"{len(shards)} shard files (or their parts): {unexpected[0]!r}"
        )


def _check_placement(cfg: Config, meta: dict) -> None:
    """Every tensor's stage and expert index exist in the config's layout: they name its file."""
    stages, experts = cfg.parallel.pipeline_model_parallel_size, cfg.model.num_experts or 0
    for key, entry in meta["tensors"].items():
        if entry["stage"] >= stages:
            raise CheckpointError(
                f"{METADATA_FILE}: tensors[{key!r}] has stage {entry['stage']}, but the config has "
                f"{stages} pipeline stage(s) (0..{stages - 1})"
            )
        expert = entry["expert"]
        if expert is not None and expert >= experts:
            raise CheckpointError(
                f"{METADATA_FILE}: tensors[{key!r}] has expert {expert}, but the config has "
                + (f"{experts} experts (0..{experts - 1})" if experts else "no experts")
            )
        if (expert is None) != (entry["ep_dim"] is None):
            raise CheckpointError(
                f"{METADATA_FILE}: tensors[{key!r}] has expert {expert} and ep_dim "
                f"{entry['ep_dim']}: an expert piece has both, a dense one neither"
            )


def broadcast_statistics(meta: dict) -> bool:
    """Whether the checkpoint stores Adafactor's statistics broadcast to the weight's shape (written
    before issue 37, without ``factored_statistics``) rather than factored (``optim/factored_form.py``)."""
    return "row_var" in kinds_of(meta) and not meta.get("factored_statistics")


def kinds_of(meta: dict) -> Tuple[str, ...]:
    """The tensor kinds each piece is stored as: the weights, and the optimizer state when saved
    (AdamW's in checkpoints that do not list it)."""
    return ("model",) + (tuple(meta.get("optimizer_kinds") or OPTIMIZER_KINDS["adam"]) if meta["optimizer"] else ())
