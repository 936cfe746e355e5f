"""Megatron-LM's ``torch_dist`` checkpoints (megatron-core dist_checkpointing on PyTorch
Distributed Checkpoint), as global canonical tensors.

    iter_0000100/metadata.json      {"sharded_backend": "torch_dist", ...}
    iter_0000100/common.pt          torch.save of what is not sharded: args, iteration, ...
    iter_0000100/.metadata          pickled DCP Metadata: every key's global shape and chunks,
                                    and where each chunk is (file, byte offset, length)
    iter_0000100/__R_I.distcp       the chunks rank R wrote, each a torch.save at an offset

Keys are megatron-core's sharded keys with global shapes and offsets, so the layout of the
saving run (TP, PP, EP, virtual stages) does not matter. Layers are stacked on a leading
dimension (``decoder.layers.self_attention.linear_qkv.weight`` is [L, 3h, h]) unless the model
had non-homogeneous layers, whose keys carry the global layer index
(``decoder.layers.3.self_attention...``); experts are a further leading dimension
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is [L, E, ffn, h], for SequentialMLP
and TEGroupedMLP alike, as megatron-core 0.16 writes it; a single ``experts.`` is read too).
Adam's state is read where it is keyed like the model (``optimizer.state.exp_avg.<key>``: the
non-distributed optimizer, and the distributed one's ``fully_reshardable`` sharding) and from the
distributed optimizer's buckets (``dp_reshardable``, its default: ``dp_reshardable.py``). Other
byte objects (RNG state, ``_extra_state``) are not read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron import dp_reshardable
from megatron_p2r.convert.megatron.args import SavedArgs
from megatron_p2r.convert.megatron.distrib_optim import groups_step
from megatron_p2r.convert.megatron.names import MTP_LAYER, expert_rest, layer_name, mtp_layer_name, split_layer_key
from megatron_p2r.convert.megatron.unpickler import Kind, LazyTensor, Opaque, TorchArchive, load_pickle, shown
from megatron_p2r.files import MiB, confined, read_json

CONFIG_FILE, COMMON_FILE, DCP_METADATA = "metadata.json", "common.pt", ".metadata"
_NOT_MODEL = ("optimizer.", "chained_", "rng_state", "rerun_state_machine")
# The non-distributed optimizer's state, keyed like the model (``optim_state_to_sharding_state``):
# Adam's moments, and under --bf16/--fp16 the fp32 main copy of each weight.
# The distributed optimizer's ``fully_reshardable`` state is keyed the same way, its mains as ``param``.
OPTIMIZER_KEYS = {
    "exp_avg": ("optimizer.state.exp_avg.",),
    "exp_avg_sq": ("optimizer.state.exp_avg_sq.",),
    "main": ("optimizer.state.fp32_param.", "optimizer.state.param."),
}
# the distributed optimizer's sharding types whose state is read (common.pt's
# ``optimizer.param_state_sharding_type``); the optimizer's own buckets, or keyed like the model
READ_SHARDING_TYPES = (dp_reshardable.SHARDING_TYPE, "fully_reshardable")


@dataclasses.dataclass(frozen=True)
class _Chunk:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    file: str
    start: int
    length: int


def read_backend(iter_dir: str) -> str:
    """``sharded_backend`` of a dist_checkpointing ``metadata.json``."""
    path = os.path.join(iter_dir, CONFIG_FILE)
    try:
        backend = read_json(path, CheckpointError, limit=16 * MiB).get("sharded_backend")
    except AttributeError as exc:
        raise CheckpointError(f"{path}: not a dist_checkpointing metadata.json ({exc})") from None
    if not isinstance(backend, str):
        raise CheckpointError(f"{path}: field sharded_backend is missing")
    return backend


def _field(record, name: str, where: str, kind: type = object, what: str = ""):
    """``record.name``, which must be a ``kind`` (``what``, in words), or an error naming it."""
    value = record.field(name) if isinstance(record, Opaque) else None
    if value is None:
        raise CheckpointError(f"{where}: field {name} is missing ({shown(record)})")
    if not isinstance(value, kind):
        raise CheckpointError(f"{where}: field {name} is {shown(value)}, expected {what or kind.__name__}")
    return value


def _count(record, name: str, where: str, default: Optional[int] = None) -> int:
    """An integer >= 0 of ``record`` (a byte offset or length, ``default`` when unset)."""
    value = record.field(name) if isinstance(record, Opaque) else None
    value = default if value is None and default is not None else _field(record, name, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{where}: field {name} is {shown(value)}, expected an integer >= 0")
    return value


def _counts(record, name: str, where: str) -> Tuple[int, ...]:
    """A tensor's shape or offsets: at most 8 integers >= 0."""
    value = _field(record, name, where)
    if (
        not isinstance(value, (list, tuple, torch.Size))
        or len(value) > 8
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    ):
        raise CheckpointError(f"{where}: field {name} is {shown(value)}, expected a list of at most 8 integers >= 0")
    return tuple(value)


def _chained(optimizer) -> bool:
    """Whether common.pt's ``optimizer`` is a ChainedOptimizer's (one entry per index)."""
    return isinstance(optimizer, dict) and bool(optimizer) and all(isinstance(k, int) for k in optimizer)


def _adam_step(optimizer, where: str):
    """Adam's step count from common.pt's ``optimizer``, or None: ``state.common_step`` (the
    non-distributed optimizer; under --bf16/--fp16 the Float16 optimizer nests torch's state dict
    in ``optimizer``; a ChainedOptimizer, as with experts under EP > 1, saves one per index) or
    the step of its param groups (the distributed one's ``fully_reshardable`` state)."""
    if _chained(optimizer):
        steps = {_adam_step(chained, where) for chained in optimizer.values()}
        if len(steps) != 1:
            raise CheckpointError(f"{where}: the chained optimizers' steps differ: {sorted(steps, key=str)}")
        return steps.pop()
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    if isinstance(inner, dict) and isinstance(inner.get("state"), dict) and "common_step" in inner["state"]:
        optimizer = inner
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    step = state.get("common_step") if isinstance(state, dict) else None
    if step is None:
        inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        return None if groups is None else groups_step(groups, f"{where}: optimizer.optimizer.param_groups")
    if not isinstance(step, LazyTensor) or step.shape not in ((), (1,)):
        raise CheckpointError(f"{where}: optimizer.state.common_step is {step!r}, expected a scalar tensor")
    return float(step.read().reshape(()))


class DistCheckpoint:
    """The model tensors of a torch_dist iteration directory; a canonical tensor is read from the
    chunks of its key that cover its index on the leading (layer, expert) dimensions."""

    format = "torch_dist"

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        backend = read_backend(iter_dir)
        if backend != "torch_dist":
            raise CheckpointError(
                f"{os.path.join(iter_dir, CONFIG_FILE)}: sharded_backend {backend!r}; only "
                "torch_dist is read (convert others with Megatron's dist_checkpointing first)"
            )
        common = TorchArchive(os.path.join(iter_dir, COMMON_FILE), Kind.MEGATRON).obj
        if not isinstance(common, dict) or "args" not in common:
            raise CheckpointError(f"{os.path.join(iter_dir, COMMON_FILE)}: no 'args' in the saved dict")
        self.saved, self.saved_path = common, os.path.join(iter_dir, COMMON_FILE)  # iteration, opt_param_scheduler
        self.args = SavedArgs.of(common["args"], self.saved_path)
        self.where = os.path.join(iter_dir, DCP_METADATA)
        metadata = load_pickle(self.where, Kind.DCP_METADATA)
        self.sizes: Dict[str, Tuple[int, ...]] = {}
        self.chunks: Dict[str, List[_Chunk]] = {}
        self.objects: Dict[str, _Chunk] = {}  # pickled objects (megatron-core's ShardedObject) by key
        self._index(
            _field(metadata, "state_dict_metadata", self.where, dict, "a dict"),
            _field(metadata, "storage_data", self.where, dict, "a dict"),
        )
        self._check_files()
        self.names: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        self.optimizer: Dict[str, Dict[str, Tuple[str, Tuple[int, ...]]]] = {kind: {} for kind in OPTIMIZER_KEYS}
        for key, size in self.sizes.items():
            kind, rest = next(
                ((k, key[len(p) :]) for k, ps in OPTIMIZER_KEYS.items() for p in ps if key.startswith(p)), (None, key)
            )
            if kind is None and key.startswith(_NOT_MODEL):
                continue
            names = self.names if kind is None else self.optimizer[kind]
            for name, prefix in self._canonical(rest, size):
                names[name] = (key, prefix)
        self.optimizer_not_read = None  # why the optimizer state that is there is skipped
        self.buckets = None  # the distributed optimizer's buckets (dp_reshardable)
        self.adam_step = self._optimizer_state(common.get("optimizer"))

    def _optimizer_state(self, optimizer) -> Optional[float]:
        """Adam's step, or None: weights only. The distributed optimizer's buckets are replayed
        (``dp_reshardable``); a sharding type not read leaves the optimizer state out and says why."""
        chained = _chained(optimizer)
        shardings = {
            o.get("param_state_sharding_type") if isinstance(o, dict) else None
            for o in (optimizer.values() if chained else [optimizer])
        }
        if len(shardings) != 1:
            raise CheckpointError(
                f"{self.saved_path}: the chained optimizers' sharding types differ: {sorted(shardings, key=str)}"
            )
        sharding = shardings.pop()
        if sharding is None or sharding == "fully_reshardable":
            return _adam_step(optimizer, self.saved_path)
        self.optimizer = {kind: {} for kind in OPTIMIZER_KEYS}
        if sharding not in READ_SHARDING_TYPES:
            self.optimizer_not_read = (
                f"{self.saved_path}: the distributed optimizer's state is saved with sharding "
                f"type {sharding!r}; only {' and '.join(READ_SHARDING_TYPES)} are read"
            )
            return None
        try:
            self.buckets = dp_reshardable.DpReshardable(
                self.args, {n: self.shape(n) for n in self.names}, self.sizes, self._read_range, self.where
            )
        except dp_reshardable.NotReplayed as why:
            self.optimizer_not_read = (
                f"{self.where}: the distributed optimizer's state of sharding type {sharding!r}: {why}"
            )
            return None
        self.optimizer = self.buckets.names
        steps = {self._param_groups_step(key) for key in self.buckets.param_group_keys}
        if len(steps) != 1:
            raise CheckpointError(
                f"{self.where}: the distributed optimizer's param groups give Adam steps {sorted(steps)}, expected one"
            )
        return steps.pop()

    def _param_groups_step(self, key: str) -> float:
        """Adam's step in the param groups of one model-parallel rank (a pickled object)."""
        chunk = self.objects.get(key)
        if chunk is None:
            raise CheckpointError(f"{self.where}: no object {key!r} (the distributed optimizer's param groups)")
        where = f"{chunk.file} (bytes {chunk.start}..{chunk.start + chunk.length}, object {key!r})"
        saved = TorchArchive(chunk.file, Kind.MEGATRON, chunk.start, chunk.length, where=where).obj
        saved = saved[0] if isinstance(saved, list) and len(saved) == 1 else saved  # a list of the rank's objects
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if groups is None:
            raise CheckpointError(f"{where}: holds {type(saved).__name__}, expected the optimizer's param groups")
        return groups_step(groups, f"{where}: param_groups")

    def _index(self, state_dict_metadata: dict, storage_data: dict) -> None:
        """Global shapes and chunk locations of every tensor key; where each object is."""
        for key, entry in state_dict_metadata.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{self.where}: state_dict_metadata has key {shown(key)}, expected strings")
            if isinstance(entry, Opaque) and entry.qualname.endswith("TensorStorageMetadata"):
                self.sizes[key] = _counts(entry, "size", self.where)
                self.chunks[key] = []
        self._index_objects(storage_data)
        sizes = {
            (key, _counts(c, "offsets", self.where)): _counts(c, "sizes", self.where)
            for key, entry in state_dict_metadata.items()
            if key in self.sizes
            for c in _field(entry, "chunks", self.where, list, "a list")
        }
        for index, info in storage_data.items():
            key = _field(index, "fqn", self.where, str, "a string")
            if key not in self.sizes:
                continue
            offsets = _counts(index, "offset", self.where)
            if info.field("transform_descriptors"):
                raise CheckpointError(
                    f"{self.where}: chunk {offsets} of {key!r} is stored with transforms "
                    f"{info.field('transform_descriptors')}; only plain torch.save chunks are read"
                )
            if (key, offsets) not in sizes:
                raise CheckpointError(
                    f"{self.where}: storage_data has a chunk at {offsets} of {key!r} that "
                    "state_dict_metadata does not list"
                )
            path = confined(
                self.iter_dir,
                _field(info, "relative_path", self.where, str, "a string"),
                CheckpointError,
                f"{self.where}: relative_path of {key!r}",
            )  # a name read from a file stays inside
            self.chunks[key].append(
                _Chunk(
                    offsets,
                    sizes[(key, offsets)],
                    path,
                    _count(info, "offset", self.where, 0),
                    _count(info, "length", self.where),
                )
            )

    def _index_objects(self, storage_data: dict) -> None:
        """Where each pickled object (``key/shard_...``) is; its first copy."""
        for index, info in storage_data.items():
            fqn = _field(index, "fqn", self.where, str, "a string")
            if fqn in self.sizes or "/shard_" not in fqn:
                continue
            key = fqn.rpartition("/shard_")[0]
            path = confined(
                self.iter_dir,
                _field(info, "relative_path", self.where, str, "a string"),
                CheckpointError,
                f"{self.where}: relative_path of {fqn!r}",
            )
            self.objects.setdefault(
                key, _Chunk((), (), path, _count(info, "offset", self.where, 0), _count(info, "length", self.where))
            )

    def _check_files(self) -> None:
        """Every chunk's file exists and is long enough (before anything is read or written)."""
        ends: Dict[str, Tuple[int, str]] = {}
        for key, chunks in self.chunks.items():
            for c in chunks:
                ends[c.file] = max(ends.get(c.file, (0, key)), (c.start + c.length, key))
        for path, (end, key) in sorted(ends.items()):
            if not os.path.isfile(path):
                raise CheckpointError(f"missing file {path} ({self.where} places chunks of {key!r} there)")
            if os.path.getsize(path) < end:
                raise CheckpointError(
                    f"{path}: truncated: {os.path.getsize(path)} bytes, {self.where} places a "
                    f"chunk of {key!r} up to byte {end}"
                )

    def _canonical(self, key: str, size: Tuple[int, ...]) -> List[Tuple[str, Tuple[int, ...]]]:
        """(canonical name, index on the key's leading dimensions) of every tensor in ``key``
        (an MTP layer's key is a layer's of its own)."""
        mtp = MTP_LAYER.fullmatch(key)
        split = split_layer_key(key)
        if mtp is not None:
            layers = [(functools.partial(mtp_layer_name, mtp.group(1)), mtp.group(2), ())]
        elif split is None:
            return [(key, ())]
        else:
            layer, rest = split
            at = [(layer, ())] if layer is not None else [(i, (i,)) for i in range(size[0])]
            layers = [(functools.partial(layer_name, i), rest, prefix) for i, prefix in at]
        out = []
        for name, rest, prefix in layers:
            if rest.startswith("mlp.experts.") and not rest.split(".")[2].isdecimal():
                leaf = rest[len("mlp.experts.") :]
                leaf = leaf[len("experts.") :] if leaf.startswith("experts.") else leaf
                out += [(name(expert_rest(e, leaf)), prefix + (e,)) for e in range(size[len(prefix)])]
            else:
                out.append((name(rest), prefix))
        return out

    def location(self, name: str) -> str:
        return self.where

    def shape(self, name: str, kind: str = "model") -> Tuple[int, ...]:
        if kind != "model" and self.buckets is not None:
            return self.buckets.shape(name)
        key, prefix = (self.names if kind == "model" else self.optimizer[kind])[name]
        return self.sizes[key][len(prefix) :]

    def read(self, name: str, kind: str = "model") -> torch.Tensor:
        """The global tensor (or its optimizer state ``kind``), assembled from the chunks of its key
        that hold its index."""
        if kind != "model" and self.buckets is not None:
            return self.buckets.read(name, kind)
        key, prefix = (self.names if kind == "model" else self.optimizer[kind])[name]
        out, filled = None, 0
        for chunk in self.chunks[key]:
            if not all(o <= i < o + s for i, o, s in zip(prefix, chunk.offsets, chunk.sizes, strict=False)):
                continue
            data = self._read_chunk(key, chunk)
            data = data[tuple(i - o for i, o in zip(prefix, chunk.offsets, strict=False))]
            if out is None:
                out = torch.empty(self.shape(name, kind), dtype=data.dtype)
            rest = chunk.offsets[len(prefix) :]
            out[tuple(slice(o, o + s) for o, s in zip(rest, data.shape, strict=True))] = data
            filled += data.numel()
        if out is None or filled != out.numel():
            raise CheckpointError(
                f"{self.where}: the chunks of {key!r} cover {filled} elements of {name} {list(self.shape(name, kind))}"
            )
        return out

    def _read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flat key ``key``, from the chunks that overlap them."""
        out, filled = None, 0
        for chunk in self.chunks.get(key, ()):
            lo, hi = max(start, chunk.offsets[0]), min(stop, chunk.offsets[0] + chunk.sizes[0])
            if lo >= hi:
                continue
            data = self._read_chunk(key, chunk)
            if out is None:
                out = torch.empty(stop - start, dtype=data.dtype)
            out[lo - start : hi - start] = data[lo - chunk.offsets[0] : hi - chunk.offsets[0]]
            filled += hi - lo
        if out is None or filled != stop - start:
            raise CheckpointError(f"{self.where}: the chunks of {key!r} cover {filled} of its elements {start}..{stop}")
        return out

    def _read_chunk(self, key: str, chunk: _Chunk) -> torch.Tensor:
        where = f"{chunk.file} (bytes {chunk.start}..{chunk.start + chunk.length}, chunk {chunk.offsets} of {key!r})"
        tensor = TorchArchive(chunk.file, Kind.TENSORS, chunk.start, chunk.length, where=where).obj
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(f"{where}: holds {type(tensor).__name__}, expected a tensor")
        if torch.Size(tensor.shape).numel() != torch.Size(chunk.sizes).numel():
            raise CheckpointError(
                f"{where}: holds a tensor of shape {list(tensor.shape)}, expected {list(chunk.sizes)}"
            )
        data = tensor.read()
        return data.reshape(chunk.sizes)
