"""The GPU lane's device: one CUDA GPU joined as a one-rank NCCL job through the project's
own start-up path (``training.resolve_device`` + ``training.init_distributed``), configs sized
for it, and the allocator statistics the memory tests read.

In a dry run (``probe.dry_run()``) the same object stands for the CPU with gloo and the
tests' CPU sizes; what only CUDA can measure skips there (``needs_cuda``).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist

from megatron_p2r.arguments import config_from_values, to_argv
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import init_distributed, resolve_device
from tests.cuda.probe import dry_run
from tests.helpers import TINY
from tools import plan as plan_tool


@dataclass
class Lane:
    device: torch.device
    dry_run: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def config(self, values: dict, gpu: Optional[dict] = None, cpu: Optional[dict] = None):
        """``tests.helpers.TINY`` + ``values`` + the sizes for this device, on this device."""
        sizes = (cpu if self.dry_run else gpu) or {}
        return config_from_values({**TINY, **values, **sizes, "device": self.device.type})

    def parallel(self, cfg) -> ParallelState:
        """This rank's ParallelState (world size 1: no groups), seeded as ``pretrain`` seeds it."""
        seed_everything(cfg.train.seed, 0, 0, self.device)
        return ParallelState.single(self.device)

    def needs_cuda(self, what: str) -> None:
        if not self.cuda:
            pytest.skip(f"dry run on CPU: {what} needs CUDA")

    # -- allocator statistics (bytes beyond a mark taken with ``mark``)
    def mark(self) -> int:
        """Synchronise, reset the peak and return the bytes allocated now."""
        self.needs_cuda("CUDA allocator statistics")
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def allocated_since(self, mark: int) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - mark

    def peak_since(self, mark: int) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - mark

    def release(self) -> None:
        """Return cached blocks so the next measurement starts from what is really alive."""
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def planned_stage(cfg) -> dict:
    """What ``tools/plan.py --world-size 1 --gpu H200-141GB --json`` plans for ``cfg``'s one
    stage: ``device`` bytes by category (params, grads, optimizer, fetch_window, activations,
    transient, reserve), ``device_total`` and ``host``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = plan_tool.main(to_argv(cfg) + ["--world-size", "1", "--gpu", "H200-141GB", "--json"])
    if status != 0:
        raise RuntimeError(f"tools/plan.py exited {status}: {out.getvalue()[-2000:]}")
    return json.loads(out.getvalue())["plans"][cfg.p2r.p2r_phase]["stages"][0]


@contextlib.contextmanager
def open_lane() -> Iterator[Lane]:
    """Join the one-rank job (NCCL on CUDA, gloo in a dry run), then leave it with every group
    made in it. No group may be open before (``init_distributed`` would join that one)."""
    cpu = dry_run()
    cfg = config_from_values({"device": "cpu" if cpu else "cuda"})
    device = resolve_device(cfg)
    expected = "gloo" if cpu else "nccl"
    if dist.is_initialized():
        raise RuntimeError(f"a {dist.get_backend()!r} process group is already open; the lane joins its own")
    init_distributed(cfg, device)
    backend = dist.get_backend()
    if backend != expected:
        raise RuntimeError(f"init_distributed joined with {backend!r}, expected {expected!r} on {device}")
    try:
        yield Lane(device=device, dry_run=cpu)
    finally:
        dist.destroy_process_group()
