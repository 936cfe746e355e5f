"""Granular CPU offload: which layer modules of a stage live on host, and the bytes that moves.

Pure selection and accounting over the tensor specs, so the ParallelPlan decides once and the
runtime (``megatron_p2r.offload``), the planner and the logs all report the same choice. Which
layers, per ``--cpu-offload-layers``: a count N (the last N layers of each stage), a fraction,
a list of global layer indices, or ``auto`` with ``--device-memory-budget`` (the fewest
layers, last ones of the stage first, whose offload makes the stage's accounted device bytes
fit). A pseudo-phase slot is one module and is offloaded (and accounted) once.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.config import (
    FULL,
    OPTIMIZERS,
    WHAT_ITEMS,
    ConfigError,
    LayerSpec,
    OffloadConfig,
    parse_layer_spec,
    parse_memory_size,
    parse_offload_what,
)
from megatron_p2r.config.optimizers import FACTOR_DTYPE

PARAM_BYTES, GRAD_BYTES, ADAM_BYTES, MASTER_BYTES = 4, 4, 8, 4  # fp32 weight, fp32 grad, 2 moments, fp32 main
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # per element of a dtype flag (moments, main grads and params)
FACTOR_BYTES = DTYPE_BYTES[FACTOR_DTYPE]  # a factored statistic (Adafactor's)
CATEGORIES = WHAT_ITEMS  # the accounted categories are what can be offloaded


def state_bytes(
    numel: int,
    param_bytes: int = PARAM_BYTES,
    owned: Optional[int] = None,
    moment_bytes: int = ADAM_BYTES,
    shape: Optional[Sequence[int]] = None,
    optimizer: str = "adam",
    grad_bytes: int = GRAD_BYTES,
    master_bytes: Optional[int] = None,
) -> Dict[str, int]:
    """Bytes of ``numel`` buffer elements (a parameter of ``shape``): weights of ``param_bytes``
    each, gradients of ``grad_bytes`` (``--main-grads-dtype``), and the optimizer state of the
    ``owned`` (default all) of them this rank steps (``optimizer_state_bytes``), plus main copies
    of ``master_bytes`` ("masters", part of "optimizer"; default fp32 when the weights are
    16-bit, none when they are fp32 and their own mains); "stepped": the elements it steps."""
    owned = numel if owned is None else owned
    if master_bytes is None:
        master_bytes = MASTER_BYTES if param_bytes != PARAM_BYTES else 0
    masters = master_bytes * owned
    moments = optimizer_state_bytes(optimizer, moment_bytes, shape or (numel,), owned)
    return {
        "params": param_bytes * numel,
        "grads": grad_bytes * numel,
        "optimizer": moments + masters,
        "masters": masters,
        "stepped": owned,
    }


def optimizer_state_bytes(optimizer: str, moment_bytes: int, shape: Sequence[int], owned: int) -> int:
    """State bytes of the ``owned`` elements of a parameter of ``shape`` this rank steps: AdamW's
    two moments or Lion's one (``moment_bytes`` per element); Adafactor's fp32 row and column
    statistics of each matrix (..., R, C) it steps any part of (every rank sharing a matrix keeps
    them whole), or a vector's elementwise variance."""
    if not OPTIMIZERS[optimizer].factored:
        return moment_bytes * owned
    if not owned:
        return 0
    if len(shape) < 2:
        return FACTOR_BYTES * owned
    return FACTOR_BYTES * math.prod(shape[:-2]) * (shape[-2] + shape[-1])


def add_bytes(total: Dict[str, int], more: Dict[str, int]) -> Dict[str, int]:
    return {k: total.get(k, 0) + v for k, v in more.items()}


def last_first(layer_keys: Sequence[int]) -> List[int]:
    """A stage's module keys, the one used last first (the order ``auto`` offloads in)."""
    return list(dict.fromkeys(reversed(list(layer_keys))))


def select_modules(spec: LayerSpec, layer_keys: Sequence[int], layer_range: Sequence[int]) -> List[int]:
    """Module keys to offload on a stage for a count / fraction / list spec (in order of use)."""
    if spec.kind == "count":
        n = min(spec.count, len(layer_keys))
    elif spec.kind == "fraction":
        n = int(math.floor(spec.fraction * len(layer_keys) + 0.5))
    elif spec.kind == "list":
        wanted = {layer_keys[layer_range.index(i)] for i in spec.layers if i in layer_range}
        return [k for k in dict.fromkeys(layer_keys) if k in wanted]
    else:
        raise ValueError(f"select_modules does not handle {spec.kind!r}")
    chosen = set(layer_keys[len(layer_keys) - n :]) if n else set()
    return [k for k in dict.fromkeys(layer_keys) if k in chosen]


def memory_plan(
    total: Dict[str, int],
    module_bytes: Dict[int, Dict[str, int]],
    offloaded: Sequence[int],
    prefetch: int,
    what: frozenset = FULL,
) -> Dict[str, Dict[str, int]]:
    """Accounted bytes on device and host when the ``what`` categories of ``offloaded`` modules
    live on host (with only the optimizer offloaded, the fp32 masters of 16-bit weights stay
    with the weights on the device: ``StagedOptimizer`` moves the moments).

    With weights on host the device also holds the fetch window: (prefetch + 2) copies of the
    largest offloaded module's weights — the one in use, ``prefetch`` fetched ahead, and its
    gradient before it goes to host.
    """
    host = {c: sum(module_bytes[k][c] for k in offloaded) if c in what else 0 for c in CATEGORIES}
    if "params" not in what:
        host["optimizer"] -= sum(module_bytes[k].get("masters", 0) for k in offloaded)
    device = {c: total[c] - host[c] for c in CATEGORIES}
    largest = max((module_bytes[k]["params"] for k in offloaded), default=0)
    device["fetch_window"] = (prefetch + 2) * largest if "params" in what else 0
    return {"device": device, "host": host}


def nvme_split(
    host: Dict[str, int], module_bytes: Dict[int, Dict[str, int]], offloaded: Sequence[int]
) -> Tuple[Dict[str, int], int]:
    """(``host``, ``memory_plan``'s, with its optimizer bytes on local NVMe instead, those bytes)
    under --cpu-offload-optimizer-nvme-path: the host keeps the page cache of the layer stepping
    and the one read ahead (``nvme_window``: twice the largest layer's optimizer bytes;
    offload/nvme.py)."""
    nvme = host["optimizer"]
    window = 2 * max((module_bytes[k]["optimizer"] for k in offloaded), default=0)
    return {**host, "optimizer": 0, "nvme_window": min(window, nvme)}, nvme


def delayed_grads_bytes(module_bytes: Dict[int, Dict[str, int]], offloaded: Sequence[int]) -> int:
    """The second gradient buffer of --cpu-offload-delayed-param-update: one more copy of the
    offloaded modules' gradient buckets (padding included), where the next iteration accumulates
    while the delayed host step reads the last one's (optim/delayed_update.py)."""
    return sum(module_bytes[k]["grads"] for k in offloaded)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def choose_auto(
    total: Dict[str, int],
    module_bytes: Dict[int, Dict[str, int]],
    candidates: Sequence[int],
    prefetch: int,
    budget: int,
    where: str,
    budget_text: str,
    what: frozenset = FULL,
) -> List[int]:
    """The fewest ``candidates`` (taken in order) whose offload makes the device bytes fit ``budget``."""
    best = None
    for k in range(len(candidates) + 1):
        plan = memory_plan(total, module_bytes, candidates[:k], prefetch, what)
        need = sum(plan["device"].values())
        if need <= budget:
            return list(candidates[:k])
        best = need if best is None else min(best, need)
    raise ConfigError(
        f"--device-memory-budget {budget_text} ({format_bytes(budget)}) cannot be met on {where}: "
        f"even with all its {len(candidates)} layer modules offloaded it needs {format_bytes(best)} "
        f"of parameters, gradients and optimizer state on the device (--cpu-offload-what "
        f"{','.join(sorted(what))}; embedding, output layer and final norm stay, and with weights on "
        f"host the fetch window of --offload-prefetch {prefetch} + 2 layers); raise the budget or use "
        f"more pipeline/tensor parallelism"
    )


def choose_offloaded(
    o: OffloadConfig,
    num_layers: int,
    layer_keys: Sequence[int],
    layer_range: Sequence[int],
    total: Dict[str, int],
    module_bytes: Dict[int, Dict[str, int]],
    where: str,
) -> List[int]:
    """The module keys of one stage that ``--cpu-offload-layers`` puts on host (in order of use)."""
    if o.cpu_offload_layers is None:
        return []
    spec = parse_layer_spec(o.cpu_offload_layers, num_layers)
    if spec.kind != "auto":
        return select_modules(spec, layer_keys, layer_range)
    picked = choose_auto(
        total,
        module_bytes,
        last_first(layer_keys),
        o.offload_prefetch,
        parse_memory_size(o.device_memory_budget),
        where,
        o.device_memory_budget,
        parse_offload_what(o.cpu_offload_what),
    )
    return [k for k in dict.fromkeys(layer_keys) if k in picked]
