"""Granular CPU offloading: chosen transformer layers keep their fp32 master weights,
gradients and AdamW state in host memory (the M6-10T paper's second technique).

Unlike offloading everything (ZeRO-Offload), only a subset of layers — chosen per stage by
``--cpu-offload-layers`` — lives on host; the rest of the rank stays on the device. For an
offloaded layer:

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
  produced them, where autograd accumulates them into the host ``.grad`` over micro-batches;
- its AdamW step runs on host (torch's AdamW on CPU tensors, a second optimizer), issued
  after the device step so the two overlap on CUDA; the next fetch picks up the new weights.

With ``--cpu-offload-what optimizer`` only the chosen layers' AdamW moments live on host
(``StagedAdamW``: the step runs there on host copies of weights and gradients).

Which layers: a count N (the last N layers of each stage), a fraction, a list of global
layer indices, or ``auto`` with ``--device-memory-budget``: the fewest layers, last ones of
the stage first, whose offload makes this rank's accounted device bytes fit. A pseudo-phase
slot is one module and is offloaded (and accounted) once. See docs/offload.md.
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call

from megatron_p2r.config import (FULL, WHAT_ITEMS, Config, ConfigError, LayerSpec, TrainConfig, parse_layer_spec,
                                 parse_memory_size, parse_offload_what)
from megatron_p2r.optim.optimizer import build_optimizer, param_groups
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.state import ParallelState

CATEGORIES = ("params", "grads", "optimizer")


# ----------------------------------------------------------------------------- which layers

def state_bytes(params) -> Dict[str, int]:
    """Bytes of parameters, gradients and AdamW moments (as training.describe_memory counts them)."""
    params = list(params)
    b = sum(p.numel() * p.element_size() for p in params)
    return {"params": b, "grads": b, "optimizer": 8 * sum(p.numel() for p in params)}


def last_first(layer_keys: Sequence[int]) -> List[int]:
    """A stage's module keys, the one used last first (the order ``auto`` offloads in)."""
    return list(dict.fromkeys(reversed(list(layer_keys))))


def select_modules(spec: LayerSpec, layer_keys: Sequence[int], layer_range: range) -> List[int]:
    """Module keys to offload on a stage for a count / fraction / list spec (in order of use)."""
    if spec.kind == "count":
        n = min(spec.count, len(layer_keys))
    elif spec.kind == "fraction":
        n = int(math.floor(spec.fraction * len(layer_keys) + 0.5))
    elif spec.kind == "list":
        wanted = {layer_keys[i - layer_range.start] for i in spec.layers if i in layer_range}
        return [k for k in dict.fromkeys(layer_keys) if k in wanted]
    else:
        raise ValueError(f"select_modules does not handle {spec.kind!r}")
    chosen = set(layer_keys[len(layer_keys) - n:]) if n else set()
    return [k for k in dict.fromkeys(layer_keys) if k in chosen]


def memory_plan(total: Dict[str, int], module_bytes: Dict[int, Dict[str, int]], offloaded: Sequence[int],
                prefetch: int, what: frozenset = FULL) -> Dict[str, Dict[str, int]]:
    """Accounted bytes on device and host when the ``what`` categories of ``offloaded`` modules
    live on host.

    With weights on host the device also holds the fetch window: (prefetch + 2) copies of the
    largest offloaded module's weights — the one in use, ``prefetch`` fetched ahead, and its
    gradient before it goes to host.
    """
    host = {c: sum(module_bytes[k][c] for k in offloaded) if c in what else 0 for c in CATEGORIES}
    device = {c: total[c] - host[c] for c in CATEGORIES}
    largest = max((module_bytes[k]["params"] for k in offloaded), default=0)
    device["fetch_window"] = (prefetch + 2) * largest if "params" in what else 0
    return {"device": device, "host": host}


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def choose_auto(total: Dict[str, int], module_bytes: Dict[int, Dict[str, int]], candidates: Sequence[int],
                prefetch: int, budget: int, where: str, budget_text: str, what: frozenset = FULL) -> List[int]:
    """The fewest ``candidates`` (taken in order) whose offload makes the device bytes fit ``budget``."""
    best = None
    for k in range(len(candidates) + 1):
        plan = memory_plan(total, module_bytes, candidates[:k], prefetch, what)
        need = sum(plan["device"].values())
        if need <= budget:
            return list(candidates[:k])
        best = need if best is None else min(best, need)
    raise ConfigError(f"--device-memory-budget {budget_text} ({format_bytes(budget)}) cannot be met on {where}: "
                      f"even with all its {len(candidates)} layer modules offloaded it needs {format_bytes(best)} "
                      f"of parameters, gradients and optimizer state on the device (--cpu-offload-what "
                      f"{','.join(sorted(what))}; embedding, output layer and final norm stay, and with weights on "
                      f"host the fetch window of --offload-prefetch {prefetch} + 2 layers); raise the budget or use "
                      f"more pipeline/tensor parallelism")


def module_bytes_of(model: nn.Module) -> Tuple[Dict[str, int], Dict[int, Dict[str, int]]]:
    """(whole stage, per layer module key) accounted bytes; works on a meta-device model."""
    return state_bytes(model.parameters()), {int(k): state_bytes(m.parameters()) for k, m in model.layers.items()}


def offload_keys(cfg: Config, ps: ParallelState, model: nn.Module) -> List[int]:
    """This rank's offloaded module keys, per --cpu-offload-layers (``model`` may be on meta)."""
    o = cfg.offload
    spec = parse_layer_spec(o.cpu_offload_layers, cfg.model.num_layers)
    if spec.kind != "auto":
        return select_modules(spec, model.layer_keys, model.layer_range)
    total, per_module = module_bytes_of(model)
    where = f"rank {ps.rank} (stage {ps.pp_rank}, tp {ps.tp_rank}, ep {ps.ep_rank})"
    chosen = choose_auto(total, per_module, last_first(model.layer_keys), o.offload_prefetch,
                         parse_memory_size(o.device_memory_budget), where, o.device_memory_budget,
                         parse_offload_what(o.cpu_offload_what))
    return [k for k in dict.fromkeys(model.layer_keys) if k in chosen]


# ----------------------------------------------------------------------------- fetching

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

    def __init__(self, model: nn.Module, keys: Sequence[int], ps: ParallelState, prefetch: int,
                 what: frozenset = FULL):
        self.model, self.prefetch, self.what = model, prefetch, what
        self.device = ps.device
        self.keys = list(keys)
        self.names = {k: [n for n, _ in model.layers[str(k)].named_parameters()] for k in self.keys}
        self.module_params = {k: [p for _, p in model.layers[str(k)].named_parameters()] for k in self.keys}
        positions = [pos for pos, k in enumerate(model.layer_keys) if k in self.module_params]
        self.order = {"forward": positions, "backward": positions[::-1]}
        self.index = {phase: {pos: i for i, pos in enumerate(seq)} for phase, seq in self.order.items()}
        self.pending: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # live: fetched layers whose device copies still exist; peak_live per pass (instrumentation)
        self.stats = {"live": 0, "peak_live": {"forward": 0, "backward": 0}, "fetches": {"forward": 0, "backward": 0}}
        if "params" in what:
            for k in self.keys:
                model.layer_runners[k] = self.run_layer

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
        return functional_call(layer, dict(zip(self.names[key], weights)), (x, rope))

    # -- copies
    def acquire(self, phase: str, position: int) -> Tuple[torch.Tensor, ...]:
        """This layer's device copy (prefetched or fetched now); queue the next ``prefetch`` of
        this pass and drop prefetches the pass no longer needs (at most prefetch + 1 live)."""
        seq, i = self.order[phase], self.index[phase][position]
        entry = self.pending.pop((phase, position), None) or self._copy(position)
        ahead = [(phase, q) for q in seq[i + 1:i + 1 + self.prefetch]]
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
        host = self.module_params[self.model.layer_keys[position]]
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
        if self.stream is None:
            return tuple(grads)
        return tuple(g.to("cpu") for g in grads)

    def synchronize(self) -> None:
        """Wait for outstanding fetches (before the host step rewrites the weights they read)."""
        if self.stream is not None:
            self.stream.synchronize()

    # -- reporting
    def describe(self) -> dict:
        """Accounted bytes per category on device and host, and what is offloaded."""
        total, per_module = module_bytes_of(self.model)
        plan = memory_plan(total, per_module, self.keys, self.prefetch, self.what)
        first = self.model.layer_range.start
        layers = [first + pos for pos, k in enumerate(self.model.layer_keys) if k in self.module_params]
        return {**plan, "modules": list(self.keys), "layers": layers, "stage_layers": len(self.model.layer_keys),
                "prefetch": self.prefetch, "what": ",".join(c for c in WHAT_ITEMS if c in self.what)}


def format_report(rank: int, report: dict) -> str:
    mib, d, h = format_bytes, report["device"], report["host"]
    return (f"[rank {rank}] offload: {report['what']} of {len(report['layers'])} of {report['stage_layers']} "
            f"layers on host (layers {report['layers']}, modules {report['modules']}, prefetch {report['prefetch']}); "
            f"device: params {mib(d['params'])}, grads {mib(d['grads'])}, optimizer {mib(d['optimizer'])}, "
            f"fetch window {mib(d['fetch_window'])}; host: params {mib(h['params'])}, grads {mib(h['grads'])}, "
            f"optimizer {mib(h['optimizer'])}")


# ----------------------------------------------------------------------------- optimizer

class _StateView:
    """optimizer.state keyed by parameter, routed to whichever optimizer owns it."""

    def __init__(self, owners: Dict[int, torch.optim.Optimizer]):
        self.owners = owners

    def __getitem__(self, p):
        return self.owners[id(p)].state[p]

    def get(self, p, default=None):
        owner = self.owners.get(id(p))
        return owner.state[p] if owner is not None and p in owner.state else default

    def __contains__(self, p) -> bool:
        owner = self.owners.get(id(p))
        return owner is not None and p in owner.state


class OffloadedOptimizer:
    """AdamW on the device for resident parameters and AdamW on host for offloaded ones, seen
    as one optimizer: ``param_groups`` (the scheduler sets their lr), ``state[param]``,
    ``state_dict`` / ``load_state_dict`` over all parameters (what checkpoints use)."""

    def __init__(self, device_opt: Optional[torch.optim.Optimizer], host_opt: Optional[torch.optim.Optimizer],
                 manager: OffloadManager):
        self.optimizers = [o for o in (device_opt, host_opt) if o is not None]
        self.device_opt, self.host_opt, self.manager = device_opt, host_opt, manager
        self.state = _StateView({id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]})

    @property
    def param_groups(self) -> list:
        """The sub-optimizers' own group dicts (torch's load_state_dict replaces them)."""
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        if self.device_opt is not None:
            self.device_opt.step()  # queued on the device; it runs while the host step computes
        if self.host_opt is not None:
            self.manager.synchronize()
            self.host_opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """torch's format, parameters numbered in ``param_groups`` order across both optimizers."""
        index, groups = {}, []
        for g in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: s for o in self.optimizers for p, s in o.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        groups, start = sd["param_groups"], 0
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        for o in self.optimizers:
            mine = groups[start:start + len(o.param_groups)]
            start += len(o.param_groups)
            ids = {i for g in mine for i in g["params"]}
            o.load_state_dict({"state": {i: s for i, s in sd["state"].items() if i in ids}, "param_groups": mine})


class StagedAdamW:
    """AdamW whose moments live on host for weights that stay on the device
    (--cpu-offload-what optimizer, ZeRO-Offload for the chosen layers).

    A torch AdamW keyed by the model's own parameters: around ``step`` (and
    ``load_state_dict``, so loaded moments land on host) each parameter's ``.data`` and
    ``.grad`` are swapped for host copies, the host kernel runs, and the updated weights are
    copied back. Per step that moves the weights and gradients to host and the weights back;
    the device weights stay the master copy, so checkpoints and resumes see no difference.
    """

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _params(self) -> list:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _on_host(self, fn) -> None:
        params = self._params()
        saved = [(p.data, p.grad) for p in params]
        with torch.no_grad():
            try:
                for p, (data, grad) in zip(params, saved):
                    p.grad = None
                    p.data = data.to("cpu", copy=True)
                    if grad is not None:
                        p.grad = grad.to("cpu", copy=True)
                fn()
            finally:
                for p, (data, grad) in zip(params, saved):
                    host = p.data
                    p.grad = None
                    p.data = data
                    data.copy_(host)
                    p.grad = grad

    def step(self) -> None:
        self._on_host(self.inner.step)

    def load_state_dict(self, sd: dict) -> None:
        self._on_host(lambda: self.inner.load_state_dict(sd))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def build_split_optimizer(model: nn.Module, t: TrainConfig, manager: OffloadManager) -> OffloadedOptimizer:
    """The usual AdamW groups (weight decay / none), each split into device and offloaded
    parameters; the offloaded ones get a host AdamW (weights on host) or a StagedAdamW."""
    offloaded = manager.offloaded_param_ids
    groups = param_groups(model, t.weight_decay)

    def part(host: bool) -> list:
        out = [{**g, "params": [p for p in g["params"] if (id(p) in offloaded) == host]} for g in groups]
        return [g for g in out if g["params"]]

    device_groups, host_groups = part(False), part(True)
    device_opt = build_optimizer(model, t, params=device_groups) if device_groups else None
    host_opt = build_optimizer(model, t, params=host_groups) if host_groups else None
    if host_opt is not None and "params" not in manager.what:
        host_opt = StagedAdamW(host_opt)
    return OffloadedOptimizer(device_opt, host_opt, manager)


# ----------------------------------------------------------------------------- building

def build_offloaded(cfg: Config, ps: ParallelState):
    """(model, optimizer, manager) of this rank with its chosen layers on host.

    The stage is built and initialised on host (init is layout- and device-invariant), then
    everything not offloaded moves to the device and the offloaded weights are pinned, so a
    stage that does not fit on the device is never materialised there.
    """
    from megatron_p2r.model.m6 import M6Model, build_model
    what = parse_offload_what(cfg.offload.cpu_offload_what)
    keys = offload_keys(cfg, ps, build_model(cfg, ps, meta=True))
    if "params" not in what:  # only the AdamW moments go to host: the model is the usual one
        model = build_model(cfg, ps)
        manager = OffloadManager(model, keys, ps, cfg.offload.offload_prefetch, what)
        return model, build_split_optimizer(model, cfg.train, manager), manager
    model = M6Model(cfg, ps, device=torch.device("cpu"))
    model.init_weights(cfg.train.seed)
    offloaded = {id(p) for k in keys for p in model.layers[str(k)].parameters()}
    if ps.device.type != "cpu":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.pin_memory() if id(p) in offloaded else p.data.to(ps.device)
            for module in model.modules():
                for name, b in module.named_buffers(recurse=False):
                    module._buffers[name] = b.to(ps.device)
    manager = OffloadManager(model, keys, ps, cfg.offload.offload_prefetch, what)
    return model, build_split_optimizer(model, cfg.train, manager), manager
