"""The fp32 mains and optimizer state of host-offloaded layers on local NVMe
(``--cpu-offload-optimizer-nvme-path DIR``; DeepSpeed's ``offload_optimizer: {device: nvme,
nvme_path: DIR}``, ZeRO-Infinity's optimizer tier).

Each rank memory-maps one file, ``DIR/optimizer-state-rank<rank>.bin`` (``MAP_SHARED``), sized
and reserved (``posix_fallocate``) at start-up, once it holds the file's lock
(``optimizer-state-rank<rank>.lock``, checkpoint/lock.py's, released at exit or by the kernel when
the process dies): a second run pointed at the same directory is refused, naming the run that
holds it, before it could resize or write a file another run has mapped; a page-aligned region per offloaded layer, in
forward order, as large as the plan's optimizer bytes of that layer on this rank (fp32 mains of
16-bit weights + the optimizer's state: ``ParallelPlan.module_state_bytes``) plus alignment. The
host optimizer's mains are moved into their layer's region when the optimizer is built; its
state, which torch creates at the first step (or a checkpoint load), right after each layer's
step (or the load), so the rank's own memory holds at most one layer's new state at a time. The
weights (fetched every micro-batch) and the fp32 gradient buckets stay in RAM; so does an fp32
weight that is its own main.

The host step goes layer by layer (serially, or on the overlapped step's workers; each layer
with its own optimizer over the shared state, ``optim/host_step.py``): when a layer's step starts, a reader thread reads that layer's and the
next layer's pages and maps them writable (``madvise(MADV_POPULATE_WRITE)``), so the next layer's
state streams in from disk while this one steps (benchmarks/nvme_offload.py measures it). Pages are the kernel's page cache: dirty ones are written back and
reclaimed by the kernel under memory pressure, not by this code. Checkpoints read and write
through the mapping, in the same format as with the state in RAM, so a run may switch between
the two across a restart.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import DirectoryLock, DirectoryLocked
from megatron_p2r.config import ConfigError
from megatron_p2r.layout.offload import format_bytes

FLAG = "--cpu-offload-optimizer-nvme-path"
STATE_FILE = "optimizer-state-rank{rank:05d}.bin"
LOCK_FILE = "optimizer-state-rank{rank:05d}.lock"
ALIGN = 64  # bytes: each tensor in the file starts on a cache line
TENSORS_PER_MAIN = 3  # a main and at most two state tensors (AdamW's moments; Adafactor's row/column)


def region_bytes(optimizer_bytes: int, mains: int) -> int:
    """A layer's region: its optimizer bytes, the alignment of each tensor, rounded up to pages."""
    need = optimizer_bytes + ALIGN * TENSORS_PER_MAIN * mains
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


def _lock(directory: str, rank: int) -> DirectoryLock:
    """This rank's file of ``directory``, held for the run: refused when another live process holds it."""
    where = f"{FLAG} {directory!r}"
    if not os.path.isdir(directory):
        raise ConfigError(f"{where}: not an existing directory (create it on the local NVMe disk)")
    lock = DirectoryLock(
        directory,
        f"training run (optimizer state of rank {rank})",
        LOCK_FILE.format(rank=rank),
        guards=os.path.join(directory, STATE_FILE.format(rank=rank)),
    )
    try:
        lock.acquire()
    except DirectoryLocked as exc:
        raise ConfigError(
            f"{where}: {exc}; two runs never share optimizer-state files: give each run its own directory"
        ) from None
    except CheckpointError as exc:
        raise ConfigError(f"{where}: {exc}: the directory must be writable") from None
    for note in lock.notes:
        print(f"{where}: {note}", flush=True)
    return lock


def _reserve(directory: str, path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` allocated on disk, or say what is wrong with ``directory``."""
    where = f"{FLAG} {directory!r}"
    old = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ConfigError(f"{where}: cannot create {path} ({e.strerror}): the directory must be writable") from None
    try:
        free = shutil.disk_usage(directory).free + old
        lacking = (
            f"{where}: this rank's optimizer state needs {format_bytes(nbytes)} ({nbytes} bytes) in {path}, "
            f"the disk has {format_bytes(free)} free"
        )
        if free < nbytes:
            raise ConfigError(lacking)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise ConfigError(f"{lacking} ({e.strerror})") from None
    finally:
        os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)  # its calls release the GIL: the reader thread blocks alone
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the pages in, read from disk and writable (no fault in the step)


def _populate(mapped: torch.Tensor, start: int, length: int) -> None:
    """Read and map bytes [start, start + length) of the file ``mapped`` (held, so the mapping
    outlives the call); where the kernel cannot populate, let it read ahead (``MADV_WILLNEED``)."""
    address = mapped.data_ptr() + start
    if _LIBC.madvise(address, length, MADV_POPULATE_WRITE) != 0:
        _LIBC.madvise(address, length, mmap.MADV_WILLNEED)


class NvmeStateFile:
    """One rank's mapped file: ``regions`` (layer key -> bytes, in file order) laid out one after
    another, each a bump allocator of ``ALIGN``-aligned tensors."""

    def __init__(self, directory: str, rank: int, regions: Dict[int, int]):
        self.path = os.path.join(directory, STATE_FILE.format(rank=rank))
        self.regions: Dict[int, List[int]] = {}  # key -> [start, end, next free byte]
        offset = 0
        for key, size in regions.items():
            self.regions[key] = [offset, offset + size, offset]
            offset += size
        self.nbytes = max(offset, mmap.PAGESIZE)  # a mapping is never empty
        self.lock = _lock(directory, rank)
        self._release = weakref.finalize(self, self.lock.release)  # at exit, or once the state is dropped
        _reserve(directory, self.path, self.nbytes)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self.map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-read-ahead")
        self.prefetch_enabled = True  # off only to measure what the prefetch buys (benchmarks/nvme_offload.py)

    def allocate(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        region = self.regions[key]
        start = -(-region[2] // ALIGN) * ALIGN
        end = start + numel * dtype.itemsize
        if end > region[1]:
            raise RuntimeError(
                f"{self.path}: layer {key}'s region ({region[1] - region[0]} bytes) is too small for "
                "its optimizer state; the plan's optimizer bytes disagree with the optimizer"
            )
        region[2] = end
        return self.bytes[start:end].view(dtype)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in the mapped file (not in the rank's own memory)."""
        return t.untyped_storage().data_ptr() == self.bytes.untyped_storage().data_ptr()

    @property
    def used_bytes(self) -> int:
        """Bytes of tensors placed so far (alignment excluded)."""
        return sum(r[2] - r[0] for r in self.regions.values())

    def prefetch(self, key: Optional[int]) -> None:
        """Have layer ``key``'s pages read and mapped writable ahead of its step, on the reader
        thread (returns at once)."""
        if key is not None and self.prefetch_enabled:
            start, end, _ = self.regions[key]
            if end > start:
                self._reader.submit(_populate, self.bytes, start, end - start)

    def evict(self) -> None:
        """Write the file back and drop its pages from the page cache, so the next reads come from
        disk (to measure the disk, not the cache)."""
        self.map.flush()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self.map.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class NvmeOptimizerState:
    """Keeps ``inner``'s (the host optimizer's) mains and state of ``layers`` (key -> its
    ``MainShard``s) in ``file``; ``order``: the keys in the order their steps start (the next
    one is prefetched). Works through the step hooks of ``stepping`` (the optimizers that step
    the layers, ``optim/host_step.layer_optimizers``) and ``inner``'s load hook."""

    def __init__(
        self,
        file: NvmeStateFile,
        inner: torch.optim.Optimizer,
        layers: Dict[int, list],
        order: Sequence[int],
        stepping: Sequence[torch.optim.Optimizer],
    ):
        self.file, self.inner, self.layers = file, inner, layers
        self.key_of = {id(ms.main): key for key, shards in layers.items() for ms in shards}
        self.next = dict(zip(order, [*order[1:], None], strict=True))
        self.slots: Dict[tuple, torch.Tensor] = {}
        with torch.no_grad():
            for key, shards in layers.items():
                for ms in shards:
                    if not ms.aliases_param:  # an fp32 copy of a 16-bit weight: into the file
                        ms.main.data = self._slot(key, ms.main, "main").copy_(ms.main.reshape(-1)).view(ms.main.shape)
        for optimizer in stepping:
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._to_file(opt))
        inner.register_load_state_dict_post_hook(self._to_file)

    def _slot(self, key: int, main: torch.Tensor, kind: str, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        like = main if like is None else like
        slot = self.slots.get((id(main), kind))
        if slot is None or slot.numel() != like.numel() or slot.dtype != like.dtype:
            slot = self.slots[id(main), kind] = self.file.allocate(key, like.numel(), like.dtype)
        return slot

    def _mains(self, opt: torch.optim.Optimizer) -> List[torch.Tensor]:
        return [m for g in opt.param_groups for m in g["params"] if id(m) in self.key_of]

    def _before_step(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        for key in dict.fromkeys(self.key_of[id(m)] for m in self._mains(opt)):
            self.file.prefetch(key)
            self.file.prefetch(self.next[key])

    def _to_file(self, opt: torch.optim.Optimizer) -> None:
        """Move the state of ``opt``'s mains that is not in the file yet (new at the first step,
        or just loaded) into it; the step count stays in RAM."""
        with torch.no_grad():
            for main in self._mains(opt):
                state = self.inner.state.get(main, {})
                for kind, value in state.items():
                    if kind != "step" and torch.is_tensor(value) and not self.file.holds(value):
                        slot = self._slot(self.key_of[id(main)], main, kind, value)
                        state[kind] = slot.copy_(value.reshape(-1)).view(value.shape)
