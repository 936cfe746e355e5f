"""The offload runtime: run a layer whose weights live on host with fetched device copies.

For an offloaded layer (weights on host, ``--cpu-offload-what params,grads,optimizer``):

- its ``nn.Parameter`` objects *are* the host tensors (pinned when the device is CUDA), so
  ``model.named_parameters()`` still returns the master weights with their sharding
  attributes and checkpoints, gradient sync and the grad norm see the same tensors as
  without offloading;
- its forward runs under activation recomputation with weights fetched by ``_Fetch``: a
  separate device copy is made just before use (``--offload-prefetch N`` layers ahead, on a
  side stream on CUDA; on CPU the same code path copies synchronously into separate
  tensors), used through ``torch.func.functional_call`` and released when the layer is done.
  Backward recomputes the layer, fetching again in reverse order with the same prefetch;
- ``_Fetch.backward`` sends the weights' gradients to host as soon as the layer's backward has
  produced them, where autograd accumulates them into the host ``.grad`` over micro-batches.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call

from megatron_p2r.config import WHAT_ITEMS
from megatron_p2r.layout.offload import add_bytes, delayed_grads_bytes, format_bytes, memory_plan, nvme_split
from megatron_p2r.optim.host_step import HostStepLink
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.state import ParallelState


class _LiveCopy:
    """Counts one fetched layer as holding device memory until all its tensors' storages die
    (a weakref on the storage fires when the last view, saved tensor or alias is gone)."""

    def __init__(self, stats: dict, tensors: Sequence[torch.Tensor]):
        self.stats, self.remaining = stats, len(tensors)
        stats["live"] += 1
        for t in tensors:
            weakref.finalize(t.untyped_storage(), self._release)

    def _release(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.stats["live"] -= 1


class _Fetch(torch.autograd.Function):
    """Host weights in, device copies out; backward sends the copies' gradients to host."""

    @staticmethod
    def forward(ctx, manager, phase, position, *host_params):
        ctx.manager = manager
        return manager.acquire(phase, position)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None) + ctx.manager.to_host(grads)


class OffloadManager:
    """This stage's offloaded modules: runs them with fetched weights (when their weights live on
    host) and reports what lives where."""

    def __init__(
        self,
        model: nn.Module,
        keys: Sequence[int],
        ps: ParallelState,
        prefetch: int,
        what: frozenset,
        module_bytes: Dict[Optional[int], Dict[str, int]],
        delayed_update: bool = False,
        host_step: Optional[HostStepLink] = None,
    ):
        self.model, self.prefetch, self.what, self.module_bytes = model, prefetch, what, module_bytes
        self.device = ps.device
        self.keys = list(keys)
        self.names = {k: [n for n, _ in model.layers[str(k)].named_parameters()] for k in self.keys}
        self.module_params = {k: [p for _, p in model.layers[str(k)].named_parameters()] for k in self.keys}
        positions = [pos for pos, k in enumerate(model.layer_keys) if k in self.module_params]
        self.order = {"forward": positions, "backward": positions[::-1]}
        self.index = {phase: {pos: i for i, pos in enumerate(seq)} for phase, seq in self.order.items()}
        self.pending: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.host_step = host_step or HostStepLink()  # a layer's fetch waits for its overlapped host step
        self.delayed_update = delayed_update  # the step plan's delayed host step: a second gradient buffer on host
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # live: fetched layers whose device copies still exist; peak_live per pass (instrumentation)
        self.stats = {"live": 0, "peak_live": {"forward": 0, "backward": 0}, "fetches": {"forward": 0, "backward": 0}}
        if "params" in what:  # the model calls these layers through the manager from now on
            for pos in positions:
                layer = model.layers[str(model.layer_keys[pos])]
                model.replace_layer_call(pos, functools.partial(self.run_layer, pos, layer))

    @property
    def forward_layers(self) -> Dict[int, set]:
        """Layer key -> its parameters' ids, in the order the forward fetches them."""
        keys = [self.model.layer_keys[pos] for pos in self.order["forward"]]
        return {k: {id(p) for p in self.module_params[k]} for k in keys}

    @property
    def offloaded_param_ids(self) -> set:
        return {id(p) for params in self.module_params.values() for p in params}

    # -- running a layer
    def run_layer(self, position: int, layer: nn.Module, x: torch.Tensor, rope) -> torch.Tensor:
        """Forward with fetched weights; under grad, as a recomputed block so that no device copy
        outlives the layer's forward, and backward fetches again for the recomputation."""
        if not torch.is_grad_enabled():
            return self._compute("forward", position, layer, x, rope)
        calls = []

        def block(x, rope):
            phase = "backward" if calls else "forward"
            calls.append(phase)
            return self._compute(phase, position, layer, x, rope)

        return tp_random.checkpoint(block, x, rope, device=self.device)

    def _compute(self, phase: str, position: int, layer: nn.Module, x: torch.Tensor, rope) -> torch.Tensor:
        key = self.model.layer_keys[position]
        weights = _Fetch.apply(self, phase, position, *self.module_params[key])
        return functional_call(layer, dict(zip(self.names[key], weights, strict=True)), (x, rope))

    # -- copies
    def acquire(self, phase: str, position: int) -> Tuple[torch.Tensor, ...]:
        """This layer's device copy (prefetched or fetched now); queue the next ``prefetch`` of
        this pass and drop prefetches the pass no longer needs (at most prefetch + 1 live)."""
        seq, i = self.order[phase], self.index[phase][position]
        entry = self.pending.pop((phase, position), None) or self._copy(position)
        ahead = [(phase, q) for q in seq[i + 1 : i + 1 + self.prefetch]]
        for stale in [k for k in self.pending if k not in ahead]:
            del self.pending[stale]
        for k in ahead:
            if k not in self.pending:
                self.pending[k] = self._copy(k[1])
        self.stats["fetches"][phase] += 1
        self.stats["peak_live"][phase] = max(self.stats["peak_live"][phase], self.stats["live"])
        tensors, event = entry
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors:
                t.record_stream(current)
        return tuple(tensors)

    def _copy(self, position: int) -> tuple:
        key = self.model.layer_keys[position]
        self.host_step.wait(key)
        host = self.module_params[key]
        if self.stream is None:
            tensors = [torch.empty_like(h).copy_(h) for h in host]
            event = None
        else:
            with torch.cuda.stream(self.stream):
                tensors = [torch.empty_like(h, device=self.device).copy_(h, non_blocking=True) for h in host]
                event = torch.cuda.Event()
                event.record(self.stream)
        _LiveCopy(self.stats, tensors)
        return tensors, event

    def to_host(self, grads: Sequence[torch.Tensor]) -> tuple:
        """The gradients on host, in the weights' dtype (16 bits when they are): on CUDA copied into
        pinned buffers (torch's caching host allocator), a direct DMA at full PCIe speed where a
        pageable copy is staged through a bounce buffer; autograd adds them in on its return, so
        the copy is complete before it."""
        if self.stream is None:
            return tuple(grads)
        host = tuple(torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True) for g in grads)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def synchronize(self) -> None:
        """Wait for outstanding fetches (before the host step rewrites the weights they read)."""
        if self.stream is not None:
            self.stream.synchronize()

    # -- reporting
    @property
    def nvme(self):
        """The host step's mapped state file (offload/nvme.py: --cpu-offload-optimizer-nvme-path), or None."""
        return self.host_step.nvme

    @property
    def fetched_param_ids(self) -> set:
        """Parameters whose layers run on device copies fetched from host (weights on host)."""
        return self.offloaded_param_ids if "params" in self.what else set()

    def describe(self) -> dict:
        """Accounted bytes per category on device and host (the plan's ``module_state_bytes`` of
        this rank), and what is offloaded."""
        total: Dict[str, int] = {}
        for part in self.module_bytes.values():
            total = add_bytes(total, part)
        per_module = {k: v for k, v in self.module_bytes.items() if k is not None}
        plan = memory_plan(total, per_module, self.keys, self.prefetch, self.what)
        if self.nvme is not None:  # --cpu-offload-optimizer-nvme-path: the host optimizer's bytes in the file
            plan["host"], plan["nvme"] = nvme_split(plan["host"], per_module, self.keys)
            plan["nvme_file"] = self.nvme.file.path
        if self.delayed_update:
            plan["host"]["grads_delayed"] = delayed_grads_bytes(per_module, self.keys)
        layers = [
            i for i, k in zip(self.model.stage.layers, self.model.layer_keys, strict=True) if k in self.module_params
        ]
        return {
            **plan,
            "modules": list(self.keys),
            "layers": layers,
            "stage_layers": len(self.model.layer_keys),
            "prefetch": self.prefetch,
            "what": ",".join(c for c in WHAT_ITEMS if c in self.what),
        }


def format_report(rank: int, report: dict) -> str:
    mib, d, h = format_bytes, report["device"], report["host"]
    return (
        f"[rank {rank}] offload: {report['what']} of {len(report['layers'])} of {report['stage_layers']} "
        f"layers on host (layers {report['layers']}, modules {report['modules']}, prefetch {report['prefetch']}); "
        f"device: params {mib(d['params'])}, grads {mib(d['grads'])}, optimizer {mib(d['optimizer'])}, "
        f"fetch window {mib(d['fetch_window'])}; host: params {mib(h['params'])}, grads {mib(h['grads'])}, "
        f"optimizer {mib(h['optimizer'])}"
        + (f", second grads (delayed update) {mib(h['grads_delayed'])}" if "grads_delayed" in h else "")
        + (
            f", NVMe page cache {mib(h['nvme_window'])}; NVMe: optimizer {mib(report['nvme'])} in {report['nvme_file']}"
            if "nvme" in report
            else ""
        )
    )
