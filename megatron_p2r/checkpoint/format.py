"""The checkpoint format (docs/checkpoint.md): which tensors exist, where each lives, how files are read.

A checkpoint of iteration N is ``<dir>/iter_000000N/`` with

    metadata.json                       format version, config, layout, phase, share pattern,
                                        iteration, consumed samples, scheduler, scaler, and
                                        every tensor's global shape / split dims / layer or slot
    mp_rank_TT_PPP_EEE.safetensors      model and optimizer tensors of TP rank TT, stage PPP,
                                        expert-parallel rank EEE
    rng_and_data/rank_RRRRR.safetensors this rank's RNG states and data position

and ``<dir>/latest_checkpointed_iteration.txt`` names the newest complete one.

The unit of storage is a *piece*: one logical tensor (``layers.3.attention.qkv.weight``), or
one expert of a stacked expert parameter under its **global** index
(``layers.3.mlp.experts.7.weight1``). Each piece is stored exactly once per TP shard: in the
file of its first pipeline stage (replicas on later stages — the tied output weight, a pseudo
slot used by several stages — are not written again), of TP rank 0 when it is not split over
TP, and of the EP rank that holds it. Data-parallel replicas therefore write once, and the
same table says where every piece is for any layout, which is what lets ``reshard`` and
``delink`` stream tensor by tensor.

Shards are real safetensors files (any safetensors reader opens them), but written and read
here by a streaming writer/reader: the header of a file is known before its tensors are, so a
converter writes one tensor at a time and reads exactly the bytes of the tensor it needs.
Nothing is ever unpickled.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_p2r.config import Config

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
RNG_DIR = "rng_and_data"
OPTIM_KINDS = ("exp_avg", "exp_avg_sq", "step")  # torch AdamW state per parameter

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}  # safetensors dtype string -> torch
_MAX_HEADER = 1 << 30


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file and the field."""


# ----------------------------------------------------------------------------- names

def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file(tp: int, pp: int, ep: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_{ep:03d}.safetensors"


def shard_header_metadata(name: str) -> Dict[str, int]:
    """The ``__metadata__`` of shard ``name``: format version and its own coordinates."""
    _, _, tp, pp, ep = name.split(".")[0].split("_")
    return {"format_version": FORMAT_VERSION, "tp": int(tp), "pp": int(pp), "ep": int(ep)}


def rng_file(rank: int) -> str:
    return os.path.join(RNG_DIR, f"rank_{rank:05d}.safetensors")


def entry_name(kind: str, key: str) -> str:
    """Name inside a shard: the piece key for weights, ``optimizer.<kind>.<key>`` for moments."""
    return key if kind == "model" else f"optimizer.{kind}.{key}"


def resolve_iteration_dir(path: str) -> str:
    """``path`` is a checkpoint directory (with the latest file) or one ``iter_*`` directory."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if not os.path.isfile(latest):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
        raise CheckpointError(f"{path} is not a checkpoint: it has neither {LATEST_FILE} nor {METADATA_FILE}")
    try:
        text = open(latest, encoding="utf-8").read().strip()
        iteration = int(text)
        if iteration < 0:
            raise ValueError
    except ValueError:  # includes UnicodeDecodeError
        raise CheckpointError(f"{latest}: expected an iteration number, found "
                              f"{open(latest, 'rb').read(40)!r}") from None
    found = os.path.join(path, iteration_dir_name(iteration))
    if not os.path.isfile(os.path.join(found, METADATA_FILE)):
        raise CheckpointError(f"{latest} names iteration {iteration}, but {found}/{METADATA_FILE} is missing")
    return found


def write_text_atomic(path: str, text: str) -> None:
    """Write via a temporary file, fsync, then ``os.replace``: readers see old or new, never half."""
    tmp = f"{path}.tmp.{os.getpid()}"
    if os.path.lexists(tmp):  # never write through a link planted at the temporary name
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the tensor table

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One piece: where it comes from, its global shape and how it is split."""

    key: str                    # name of the piece (expert pieces: expert_key(param, e))
    param: str                  # logical parameter name (the stacked name for experts)
    shape: Tuple[int, ...]      # global shape of the piece (one expert's shape for experts)
    dtype: str                  # safetensors dtype string
    tp_dim: Optional[int]       # dimension of ``shape`` split over TP, or None (stored by TP rank 0)
    expert: Optional[int]       # global expert index; the stacked parameter's dim 0 is split over EP
    stage: int                  # pipeline stage whose file holds the piece
    module_key: Optional[int]   # K for pieces under ``layers.K.``
    layers: Tuple[int, ...]     # global layers that call module K (several in the pseudo phase)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=_TORCH_DTYPES[self.dtype]).element_size()

    def to_json(self) -> dict:
        return {"param": self.param, "shape": list(self.shape), "dtype": self.dtype, "tp_dim": self.tp_dim,
                "ep_dim": 0 if self.expert is not None else None, "expert": self.expert,
                "stage": self.stage, "module_key": self.module_key, "layers": list(self.layers)}

    @classmethod
    def from_json(cls, key: str, d: dict) -> "TensorInfo":
        try:
            return cls(key=key, param=d["param"], shape=tuple(d["shape"]), dtype=d["dtype"], tp_dim=d["tp_dim"],
                       expert=d["expert"], stage=d["stage"], module_key=d["module_key"], layers=tuple(d["layers"]))
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{METADATA_FILE}: tensors[{key!r}] is malformed ({exc!r})") from None


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What decides file placement: TP, EP and the layers of each pipeline stage."""

    tp: int
    ep: int
    stage_layers: Tuple[Tuple[int, int], ...]   # [start, stop) of each stage
    num_experts: int = 0

    @property
    def pp(self) -> int:
        return len(self.stage_layers)

    @classmethod
    def of(cls, cfg: Config) -> "ShardLayout":
        from megatron_p2r.model.m6 import stage_ranges
        p = cfg.parallel
        return cls(tp=p.tensor_model_parallel_size, ep=p.expert_model_parallel_size,
                   stage_layers=tuple((r.start, r.stop) for r in stage_ranges(cfg)),
                   num_experts=cfg.model.num_experts or 0)

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "stage_layers": [list(r) for r in self.stage_layers]}

    def ep_rank_of(self, info: TensorInfo) -> int:
        return 0 if info.expert is None else info.expert // (self.num_experts // self.ep)

    def tp_ranks_of(self, info: TensorInfo) -> range:
        return range(self.tp) if info.tp_dim is not None else range(1)

    def file_of(self, info: TensorInfo, tp_rank: int) -> str:
        """The file holding TP shard ``tp_rank`` of ``info`` (shard 0 for unsplit pieces)."""
        return shard_file(tp_rank if info.tp_dim is not None else 0, info.stage, self.ep_rank_of(info))

    def local_shape(self, info: TensorInfo) -> Tuple[int, ...]:
        shape = list(info.shape)
        if info.tp_dim is not None:
            shape[info.tp_dim] //= self.tp
        return tuple(shape)

    def stage_files(self, stage: int) -> List[str]:
        return [shard_file(t, stage, e) for e in range(self.ep) for t in range(self.tp)]

    def files(self) -> List[str]:
        return [f for s in range(self.pp) for f in self.stage_files(s)]


def _module_key(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def tensor_table(cfg: Config) -> Dict[str, TensorInfo]:
    """Every piece of the model ``cfg`` describes, in file order (stage by stage).

    Built from the model code itself (one meta-device build per stage), so the table cannot
    drift from what training holds.
    """
    return dict(_tensor_table(_table_fingerprint(cfg)))


def _table_fingerprint(cfg: Config) -> str:
    return json.dumps({"model": dataclasses.asdict(cfg.model), "parallel": dataclasses.asdict(cfg.parallel),
                       "p2r": dataclasses.asdict(cfg.p2r)}, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _tensor_table(fingerprint: str) -> Tuple[Tuple[str, TensorInfo], ...]:
    from megatron_p2r.model.m6 import build_model, model_layer_keys
    from megatron_p2r.parallel.sharding import expert_key, global_shape, logical_name
    from megatron_p2r.parallel.state import Layout, ParallelState
    cfg = Config.from_dict(json.loads(fingerprint))
    p = cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    layout = Layout(tp=tp, pp=pp, dp=ep, ep=ep)
    keys = model_layer_keys(cfg)
    users: Dict[int, List[int]] = {}
    for layer, k in enumerate(keys):
        users.setdefault(k, []).append(layer)
    table: Dict[str, TensorInfo] = {}
    for stage in range(pp):
        model = build_model(cfg, ParallelState(layout=layout, rank=layout.rank(0, 0, stage)), meta=True)
        for name, param in model.named_parameters():
            logical = logical_name(name, param)
            mk = _module_key(logical)
            common = dict(param=logical, dtype=_DTYPES[param.dtype], stage=stage, module_key=mk,
                          layers=tuple(users.get(mk, ())) if mk is not None else ())
            shape = global_shape(param, tp, ep)
            tp_dim = getattr(param, "tp_dim", None)
            if getattr(param, "expert", False):
                for e in range(shape[0]):
                    key = expert_key(logical, e)
                    if key not in table:
                        table[key] = TensorInfo(key=key, shape=tuple(shape[1:]), expert=e,
                                                tp_dim=None if tp_dim is None else tp_dim - 1, **common)
            elif logical not in table:
                table[logical] = TensorInfo(key=logical, shape=tuple(shape), expert=None, tp_dim=tp_dim, **common)
    return tuple(table.items())


def file_entries(table: Dict[str, TensorInfo], layout: ShardLayout, kinds: Sequence[str]) -> Dict[str, list]:
    """file -> [(entry name, dtype, local shape)] in write order, for every file of ``layout``."""
    out: Dict[str, list] = {f: [] for f in layout.files()}
    for info in table.values():
        local = layout.local_shape(info)
        for t in layout.tp_ranks_of(info):
            entries = out[layout.file_of(info, t)]
            for kind in kinds:
                if kind == "step":
                    entries.append((entry_name(kind, info.key), "F32", ()))
                else:
                    entries.append((entry_name(kind, info.key), info.dtype, local))
    return out


# ----------------------------------------------------------------------------- metadata

def write_metadata(iter_dir: str, metadata: dict) -> None:
    path = os.path.join(iter_dir, METADATA_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(metadata, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


REQUIRED_FIELDS = ("format_version", "iteration", "consumed_samples", "config", "layout", "p2r", "optimizer",
                   "tensors", "files")


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


_FIELD_TYPES = {"iteration": int, "consumed_samples": int, "config": dict, "layout": dict, "p2r": dict,
                "optimizer": bool, "tensors": dict, "files": dict, "scheduler": dict, "scaler": dict}


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
    return ("model",) + (OPTIM_KINDS if meta["optimizer"] else ())


# ----------------------------------------------------------------------------- shard files

def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    n = torch.empty((), dtype=_TORCH_DTYPES[dtype]).element_size()
    for s in shape:
        n *= s
    return n


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in the order its header announces.

    The header (names, dtypes, shapes, offsets) is written first, so memory never holds more
    than the tensor being written; ``close`` fails if any announced tensor is missing.
    """

    def __init__(self, path: str, entries: Sequence[tuple], metadata: Optional[Dict[str, str]] = None):
        self.path, self.entries, self.next = path, list(entries), 0
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name, dtype, shape in self.entries:
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(blob)) + blob)
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.entries):
            raise CheckpointError(f"{self.path}: tensor {name!r} is not announced in the header")
        want, dtype, shape = self.entries[self.next]
        if name != want or _DTYPES[tensor.dtype] != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: expected tensor {want!r} {dtype}{list(shape)} next, "
                                  f"got {name!r} {_DTYPES.get(tensor.dtype)}{list(tensor.shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.fh.write(memoryview(data.numpy()))
        self.bytes_written += data.numel()
        self.next += 1

    def close(self) -> None:
        missing = [e[0] for e in self.entries[self.next:]]
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} announced tensors were never written, "
                                  f"first {missing[0]!r}")


def save_tensors(path: str, tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> None:
    """A whole small dict (RNG states) as one safetensors file."""
    writer = ShardWriter(path, [(k, _DTYPES[v.dtype], tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()


class ShardReader:
    """The header of one safetensors file, checked against the file size; reads single tensors."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"missing shard {path}") from None
        self.size = size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"truncated shard {path}: {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"truncated shard {path}: header of {n} bytes announced, file has {size} bytes")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"corrupt shard {path}: header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"corrupt shard {path}: header is a JSON {type(header).__name__}, not an object")
        self.metadata = header.pop("__metadata__", {}) or {}
        for name, e in header.items():
            _check_entry(path, name, e)
        self.data_start = 8 + n
        self.entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(f"truncated shard {path}: its tensors need {self.data_start + end} bytes, "
                                  f"the file has {size}")

    def names(self) -> List[str]:
        return list(self.entries)

    def check(self, name: str, dtype: str, shape: Sequence[int], field: str = "shape") -> None:
        """Fail, naming file and tensor, unless ``name`` is stored with ``dtype`` and ``shape``."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} listed in {METADATA_FILE} is not in the shard")
        if entry["dtype"] != dtype:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, "
                                  f"{METADATA_FILE} says {dtype}")
        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(entry['shape'])}, expected "
                                  f"{list(shape)} from {METADATA_FILE} ({field})")

    def read(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``name``, read straight into ``out`` (a contiguous CPU tensor of its shape) if given."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        start, end = entry["data_offsets"]
        dtype, shape = _TORCH_DTYPES[entry["dtype"]], tuple(entry["shape"])
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor {name!r} is {entry['dtype']}{list(shape)}, cannot read it "
                                  f"into {out.dtype}{list(out.shape)}")
        with open(self.path, "rb") as fh:
            fh.seek(self.data_start + start)
            if end > start and fh.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy())) != end - start:
                raise CheckpointError(f"truncated shard {self.path}: tensor {name!r} is cut short")
        return out


def _check_entry(path: str, name: str, e) -> None:
    """One header entry is a known dtype, a shape, and offsets spanning exactly its bytes."""
    ok = (isinstance(e, dict) and e.get("dtype") in _TORCH_DTYPES and isinstance(e.get("shape"), list)
          and all(isinstance(s, int) and s >= 0 for s in e["shape"]) and isinstance(e.get("data_offsets"), list)
          and len(e["data_offsets"]) == 2 and all(isinstance(o, int) for o in e["data_offsets"]))
    if not ok or not 0 <= e["data_offsets"][0] <= e["data_offsets"][1] or \
            e["data_offsets"][1] - e["data_offsets"][0] != _nbytes(e["dtype"], e["shape"]):
        raise CheckpointError(f"corrupt shard {path}: header entry {name!r} is not a valid tensor "
                              f"(dtype, shape, data_offsets): {json.dumps(e)[:120]}")


class ReaderCache:
    """Parsed headers by path (a converter touches each file many times)."""

    def __init__(self, root: str):
        self.root, self._readers = root, {}

    def __call__(self, name: str) -> ShardReader:
        if name not in self._readers:
            self._readers[name] = ShardReader(os.path.join(self.root, name))
        return self._readers[name]


def check_files(iter_dir: str, meta: dict, readers: Optional[ReaderCache] = None) -> ReaderCache:
    """Every shard ``meta`` lists exists, has its recorded size and holds exactly the expected
    tensors with the expected shapes (headers only; no tensor data is read)."""
    readers = readers or ReaderCache(iter_dir)
    cfg = metadata_config(meta)
    layout = ShardLayout.of(cfg)
    expected = file_entries(metadata_table(meta), layout, kinds_of(meta))
    for name, entries in expected.items():
        recorded = meta["files"].get(name)
        if recorded is None:
            raise CheckpointError(f"{os.path.join(iter_dir, METADATA_FILE)}: files has no entry for {name}, "
                                  f"which the layout {layout.to_json()} needs")
        reader = readers(name)
        if reader.size != recorded:
            raise CheckpointError(f"{reader.path}: {reader.size} bytes, but {METADATA_FILE} files[{name!r}] "
                                  f"records {recorded} (truncated or replaced?)")
        for entry, dtype, shape in entries:
            reader.check(entry, dtype, shape)
        extra = set(reader.names()) - {e[0] for e in entries}
        if extra:
            raise CheckpointError(f"{reader.path}: holds tensors {METADATA_FILE} does not list, "
                                  f"e.g. {sorted(extra)[0]!r}")
    return readers
