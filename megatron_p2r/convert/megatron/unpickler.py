"""Megatron-LM's pickled files, read without executing pickled code.

Megatron writes pickles: ``model_optim_rng.pt`` and ``common.pt`` (``torch.save``: a zip
holding ``data.pkl`` and one record per tensor storage), the ``.metadata`` of a torch_dist
checkpoint (a plain ``pickle.dump`` of PyTorch DCP's metadata classes) and each tensor chunk
inside a ``.distcp`` file (``torch.save`` again, at a byte offset). A pickle names the
callables it wants run (``find_class``); ours returns only what the allow-list of the file's
``Kind`` holds and refuses anything else, naming the file and the class, before it is called.

What each kind admits, and why (pickle's own opcodes build dicts, lists, tuples, str, bytes,
int, float, bool and None without any class):

- ``TENSORS`` (a ``.distcp`` chunk): ``torch._utils._rebuild_tensor_v2`` and
  ``_rebuild_parameter``, the ``torch.*Storage`` type names (a dtype), ``collections.OrderedDict``
  (``torch.save`` records a tensor's backward hooks as one). The rebuild functions are ours:
  they return a ``LazyTensor`` (where the bytes are), nothing is read until asked.
- ``MEGATRON`` (``model_optim_rng.pt``, ``common.pt``): ``TENSORS`` plus ``argparse.Namespace``
  (the saved args, which give the model config), torch dtype names (``args.params_dtype``),
  ``torch.Size`` (read as a tuple), ``_codecs.encode`` for latin-1 text only and ``bytes()``
  without arguments (how protocol 2 writes ``bytes`` and empty ``bytes``), and three kinds of
  values we never use, read as inert ``Opaque`` records (class name, arguments, state; no code
  of theirs is imported or run): numpy arrays and dtypes (the RNG state), ``megatron.*``
  classes (enum values in the args such as ``AttnBackend``), ``signal.Signals`` (Megatron-LM
  saves ``args.exit_signal = signal.SIGTERM``) and ``io.BytesIO`` (Transformer Engine's
  ``_extra_state``).
- ``DCP_METADATA`` (``.metadata``): ``torch.Size``, torch dtype/layout/memory-format names,
  ``collections.OrderedDict``, and as ``Opaque`` records the ``torch.distributed.checkpoint.*``
  dataclasses, ``torch.serialization._get_layout``, ``pathlib`` paths and ``megatron.*``
  classes.

``torch.load(weights_only=True)`` reads the ``.distcp`` chunks but not ``model_optim_rng.pt``
or ``common.pt`` (argparse.Namespace, numpy) nor ``.metadata`` (not a ``torch.save`` file), and
for the chunks it admits more globals than ``TENSORS`` does; so these allow-lists are used for
every file. They also stream: a tensor's bytes are read from its zip record on demand.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import math
import os
import pickle
import reprlib
import struct
import zipfile
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron_p2r.checkpoint.errors import CheckpointError


class Kind(enum.Enum):
    TENSORS = "tensor chunk"
    MEGATRON = "Megatron state"
    DCP_METADATA = "DCP metadata"


class UnpicklingRefused(CheckpointError):
    """A pickle asked for a class or function outside its allow-list (nothing was run)."""


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_SIGNALS = {("signal", "Signals"), ("signal", "Handlers")}  # args.exit_signal (signal.SIGTERM by default)
_NUMPY = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 6, 6, 4, 40, 40


def shown(value) -> str:
    """A value read from a file, for a message: bounded however large or deeply nested (a list
    that holds itself many times over is printed in a line, not in exponential time)."""
    return _SHOWN.repr(value)


class Opaque:
    """An inert stand-in for an admitted object we do not use: its class name, the arguments it
    was built with and the state pickle gave it. Subclassed per class name (``opaque_class``)."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def field(self, name: str, default=None):
        """A dataclass field from the pickled state (a dict, or (dict, slots) for slotted classes)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict) or s is None for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<{self.qualname} {shown(self.args)}>"


_OPAQUE_CLASSES: Dict[str, type] = {}


def opaque_class(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _OPAQUE_CLASSES:
        _OPAQUE_CLASSES[qualname] = type(name, (Opaque,), {"qualname": qualname})
    return _OPAQUE_CLASSES[qualname]


@dataclasses.dataclass(frozen=True)
class _Storage:
    archive: "TorchArchive"
    key: str
    dtype: torch.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor of a ``torch.save`` archive, not read yet: its storage record and its view."""

    storage: _Storage
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def read(self) -> torch.Tensor:
        """The tensor, read from the file into fresh memory (only the bytes of its view).

        The view (offset, shape, strides: numbers from the pickle) is checked against the bytes
        its record really has before anything is allocated, so a forged stride or element count
        is an error, not a terabyte allocation."""
        where, key = self.storage.archive.where, self.storage.key
        dims = (self.offset, *self.shape, *self.stride)
        if len(self.shape) != len(self.stride) or not all(isinstance(n, int) and n >= 0 for n in dims):
            raise CheckpointError(
                f"{where}: a tensor view of data/{key} has offset {self.offset}, shape "
                f"{list(self.shape)}, strides {list(self.stride)}; expected integers >= 0"
            )
        held = min(self.storage.numel, self.storage.archive.record_size(key) // self.dtype.itemsize)
        numel = math.prod(self.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) if numel else 0
        if self.offset + span > held or numel > held:
            raise CheckpointError(
                f"{where}: a tensor view of shape {list(self.shape)}, strides {list(self.stride)} "
                f"reaches past its storage record data/{key} ({held} elements of {self.dtype})"
            )
        flat = torch.empty(span, dtype=self.dtype)
        self.storage.archive.read_record(key, self.offset * flat.element_size(), flat)
        return flat.as_strided(self.shape, self.stride).contiguous()


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError(f"_rebuild_tensor_v2 got {type(storage).__name__}, not a storage")
    return LazyTensor(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return data


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode is admitted only for latin-1 text, got {encoding!r}")
    return text.encode("latin1")


def _empty_bytes(*args) -> bytes:
    if args:
        raise pickle.UnpicklingError("bytes() is admitted only without arguments (protocol 2's empty bytes)")
    return b""


_TENSOR_GLOBALS: Dict[Tuple[str, str], Callable] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
_MEGATRON_GLOBALS = {
    **_TENSOR_GLOBALS,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch", "Size"): tuple,
    ("_codecs", "encode"): _latin1_bytes,
    ("__builtin__", "bytes"): _empty_bytes,
    ("builtins", "bytes"): _empty_bytes,
}
_DCP_GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict, ("torch", "Size"): tuple}


def _admitted(kind: Kind, module: str, name: str) -> Optional[Any]:
    """What ``find_class(module, name)`` returns for a file of ``kind``, or None (refused)."""
    exact = {Kind.TENSORS: _TENSOR_GLOBALS, Kind.MEGATRON: _MEGATRON_GLOBALS, Kind.DCP_METADATA: _DCP_GLOBALS}[kind]
    if (module, name) in exact:
        return exact[(module, name)]
    if module == "torch" and kind != Kind.DCP_METADATA and name in _STORAGE_DTYPES:
        return _STORAGE_DTYPES[name]
    if module == "torch" and kind != Kind.TENSORS and isinstance(getattr(torch, name, None), _TORCH_VALUES):
        return getattr(torch, name)
    inert = module.split(".")[0] == "megatron"
    if kind == Kind.MEGATRON:
        inert = (
            inert
            or (module, name) in _NUMPY
            or (module in ("_io", "io") and name == "BytesIO")
            or (module, name) in _SIGNALS
        )
    elif kind == Kind.DCP_METADATA:
        inert = (
            inert
            or module.startswith("torch.distributed.checkpoint")
            or module == "pathlib"
            or (module, name) == ("torch.serialization", "_get_layout")
        )
    return opaque_class(module, name) if inert else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, kind: Kind, where: str, archive: Optional["TorchArchive"] = None):
        super().__init__(io.BytesIO(data))
        self.kind, self.where, self.archive = kind, where, archive

    def find_class(self, module, name):
        found = _admitted(self.kind, module, name)
        if found is None:
            raise UnpicklingRefused(
                f"{self.where}: refusing to unpickle {module}.{name}: a {self.kind.value} file may hold only "
                "tensors, plain containers and the values listed in docs/megatron.md (nothing was executed)"
            )
        return found

    def persistent_load(self, pid):
        if self.archive is None or not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {key!r} has no known dtype ({dtype!r})")
        return _Storage(self.archive, str(key), dtype, int(numel))


def _unpickle(data: bytes, kind: Kind, where: str, archive: Optional["TorchArchive"] = None) -> Any:
    try:
        return _Unpickler(data, kind, where, archive).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or corrupt pickle: any error of the pickle machine
        raise CheckpointError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})") from None


def load_pickle(path: str, kind: Kind) -> Any:
    """A plain pickle file (a torch_dist ``.metadata``), unpickled with ``kind``'s allow-list."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    return _unpickle(data, kind, path)


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file (a zip inside a .distcp)."""

    def __init__(self, fh, start: int, length: int):
        super().__init__()
        self.fh, self.start, self.length, self.pos = fh, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.length - self.pos))
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


_LOCAL_HEADER = struct.Struct("<4s5H3I2H")


class TorchArchive:
    """A ``torch.save`` zip: a whole file, or ``length`` bytes at ``start`` of one (a DCP chunk).
    ``obj`` is its unpickled content with ``LazyTensor`` leaves; ``read_record`` reads the bytes
    of one storage record straight into a tensor."""

    def __init__(self, path: str, kind: Kind, start: int = 0, length: Optional[int] = None, where: str = ""):
        self.path, self.start = path, start
        self.where = where or path
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size if length is None else length
                with zipfile.ZipFile(_Window(fh, start, size)) as zf:
                    self._refuse_compressed(zf)
                    pickle_name = self._pickle_name(zf)
                    prefix = pickle_name[: -len("data.pkl")]
                    self.records = {
                        i.filename[len(prefix) + 5 :]: self._data_span(fh, i)
                        for i in zf.infolist()
                        if i.filename.startswith(prefix + "data/")
                    }
                    order = zf.read(prefix + "byteorder") if prefix + "byteorder" in zf.namelist() else b"little"
                    data = zf.read(pickle_name)
        except FileNotFoundError:
            raise CheckpointError(f"missing file {path}") from None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
            raise CheckpointError(
                f"{self.where}: not a zip archive written by torch.save (PyTorch >= 1.6) or truncated ({exc})"
            ) from None
        if order.strip() != b"little":
            raise CheckpointError(f"{self.where}: byteorder {order!r}; only little-endian files are read")
        self.obj = _unpickle(data, kind, self.where, self)

    def _pickle_name(self, zf: zipfile.ZipFile) -> str:
        names = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(names) != 1:
            raise CheckpointError(f"{self.where}: expected one <archive>/data.pkl record, found {names}")
        return names[0]

    def _refuse_compressed(self, zf: zipfile.ZipFile) -> None:
        """torch.save stores every record uncompressed; a compressed one (a deflated data.pkl of
        a few MiB can inflate to GiB) is refused before anything is inflated."""
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(
                    f"{self.where}: record {info.filename} is compressed ({info.file_size:,} bytes "
                    f"inflated from {info.compress_size:,}); torch.save stores its records "
                    "uncompressed, so this is not a file it wrote"
                )

    def _data_span(self, fh, info: zipfile.ZipInfo) -> Tuple[int, int]:
        """(absolute file offset, size) of a stored record's bytes, from its local header."""
        fh.seek(self.start + info.header_offset)
        header = fh.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: record {info.filename} has no local zip header")
        fields = _LOCAL_HEADER.unpack(header)
        return self.start + info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1], info.file_size

    def record_size(self, key: str) -> int:
        """The bytes storage record ``key`` really has (its zip entry, not the pickle's claim)."""
        if key not in self.records:
            raise CheckpointError(f"{self.where}: storage record data/{key} is missing")
        return self.records[key][1]

    def read_record(self, key: str, byte_offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes of storage record ``key`` from ``byte_offset`` on."""
        size = self.record_size(key)
        start = self.records[key][0]
        raw = out.view(-1).view(torch.uint8)
        if byte_offset + raw.numel() > size:
            raise CheckpointError(
                f"{self.where}: storage record data/{key} has {size} bytes, a tensor needs {byte_offset + raw.numel()}"
            )
        with open(self.path, "rb") as fh:
            fh.seek(start + byte_offset)
            got = fh.readinto(memoryview(raw.numpy()))
        if got != raw.numel():
            raise CheckpointError(
                f"{self.where}: truncated: storage record data/{key} ends after {got} of {raw.numel()} bytes"
            )
