"""What each spawned rank runs for the fully parallel save tests (no pytest import: ranks start
faster). DP2 with dropout on, with and without the distributed optimizer."""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_p2r.checkpoint import safetensors_io
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.training import setup_parallel
from tests.checkpoint.common import cfg_of
from tests.helpers import run_steps


class MaterialisedBytes(TorchDispatchMode):
    """The peak bytes of new storages operators created and that are still alive (views and
    in-place results reuse their input's storage and count nothing): what a save holds beyond
    the state it had."""

    def __init__(self):
        super().__init__()
        self.live = self.total = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.total = max(self.total, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


def _own_state(state) -> tuple:
    """(bytes, largest fp32 tensor's bytes) of this rank's mains and moments."""
    sizes = [4 * (ms.end - ms.start) for ms in state.optimizer.shards]
    moments = [state.optimizer.inner[ms.placement].state[ms.main] for ms in state.optimizer.shards]
    return sum(sizes) + sum(m[k].numel() * m[k].element_size() for m in moments for k in m if k != "step"), max(sizes)


def _reads(into: list):
    """Record every (file, tensor) a ShardReader reads."""
    original = safetensors_io.ShardReader.read

    def read(self, name, out=None):
        into.append((os.path.basename(self.path), name))
        return original(self, name, out)

    safetensors_io.ShardReader.read = read
    return original


def save_and_resume(rank: int, world: int, root: str, flags: dict) -> dict:
    """2 steps; save fully parallel (counting the bytes it materialises) and with one writer;
    2 more steps. Then resume the parallel save (also with --ckpt-fully-parallel-load, recording
    what it reads) and the single-writer save, 2 steps each."""
    c = cfg_of(global_batch_size=8, **flags)
    ps, _ = setup_parallel(c, torch.device("cpu"))
    par, single = os.path.join(root, "par"), os.path.join(root, "single")
    out = {}

    def save_after_2(state) -> None:
        if state.iteration != 2:
            return
        counter = MaterialisedBytes()
        with counter:
            save_checkpoint(par, state)
        out["parallel_bytes"] = counter.total
        counter = MaterialisedBytes()
        state.cfg = cfg_of(global_batch_size=8, ckpt_fully_parallel_save=False, **flags)
        with counter:
            save_checkpoint(single, state)
        state.cfg = c
        out["single_bytes"] = counter.total
        out["own_bytes"], out["largest"] = _own_state(state)

    out["straight"], _ = run_steps(c, ps, 4, after_step=save_after_2)
    out["resumed"], _ = run_steps(c, ps, 2, load=par)
    out["from_single"], _ = run_steps(c, ps, 2, load=single)
    reads: list = []
    original = _reads(reads)
    try:
        out["parallel_load"], _ = run_steps(
            cfg_of(global_batch_size=8, ckpt_fully_parallel_load=True, **flags), ps, 2, load=par
        )
    finally:
        safetensors_io.ShardReader.read = original
    out["moment_reads"] = sorted({f for f, name in reads if name.startswith("optimizer.exp_avg")})
    return out


def each_case(rank: int, world: int, root: str, cases: dict) -> dict:
    """``save_and_resume`` for every case, under ``root/<case>`` (one spawn)."""
    return {name: save_and_resume(rank, world, os.path.join(root, name), flags) for name, flags in cases.items()}
