"""The offload section and its flags' syntax: --cpu-offload-layers, --cpu-offload-what and
--device-memory-budget are parsed here, so a bad value fails at validation and
``layout/offload.py`` (selection, accounting) and ``megatron_p2r/offload`` (the runtime) read the parsed forms."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import LAYERS, at_least

WHAT_ITEMS = ("params", "grads", "optimizer")
FULL = frozenset(WHAT_ITEMS)
OPTIMIZER_ONLY = frozenset({"optimizer"})

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class OffloadConfig:
    cpu_offload_layers: Optional[str] = opt(None, "Layers kept on host: N | 0.25 | 1,5,7 | auto.")
    cpu_offload_what: str = opt("params,grads,optimizer", "What of the offloaded layers lives on host.")
    offload_prefetch: int = opt(1, "Offloaded layers fetched ahead of use.")
    device_memory_budget: Optional[str] = opt(None, "With --cpu-offload-layers auto, e.g. 30GiB.")
    overlap_cpu_optimizer_d2h_h2d: bool = opt(
        False,
        "Step the host-resident layers' optimizer on a worker thread, "
        "overlapped with the resident step and the next forward "
        "(each layer's fetch waits for its own step); with "
        "--clip-grad 0 and no fp16, each layer's step starts in "
        "backward once its gradients are final.",
    )
    host_optimizer_threads: str = opt(
        "auto",
        "Threads of this rank's host optimizer step (serial or overlapped): "
        "auto (the cores this process may run on divided by "
        "LOCAL_WORLD_SIZE, as ZeRO-Offload) or N; independent of "
        "OMP_NUM_THREADS.",
    )
    cpu_offload_optimizer_nvme_path: Optional[str] = opt(
        None,
        "Directory on local NVMe for the offloaded layers' "
        "fp32 mains and optimizer state (one memory-mapped "
        "file per rank; DeepSpeed's offload_optimizer nvme_path).",
    )
    cpu_offload_delayed_param_update: bool = opt(
        False,
        "ZeRO-Offload's one-step delayed parameter update (DPU): "
        "the host step of iteration t runs during iteration t+1, "
        "whose offloaded layers still use the weights it started "
        "with; the new weights are used from iteration t+2. Needs "
        "--overlap-cpu-optimizer-d2h-h2d and 16-bit weights.",
    )
    cpu_offload_delayed_param_update_warmup_steps: int = opt(
        40,
        "Optimizer steps (skipped iterations not counted) "
        "taken without delay before "
        "--cpu-offload-delayed-param-update starts, as "
        "ZeRO-Offload turns DPU on after its first steps.",
    )

    def __post_init__(self):
        """A count stored as a number (the field's type before ``auto`` existed: the configs of older
        checkpoints) reads as the flag's text."""
        if isinstance(self.host_optimizer_threads, int) and not isinstance(self.host_optimizer_threads, bool):
            object.__setattr__(self, "host_optimizer_threads", str(self.host_optimizer_threads))

    def check(self, num_layers: int) -> None:
        """Each flag parses, and the budget comes with ``auto`` and only with it."""
        parse_offload_what(self.cpu_offload_what)  # how the host step combines with the rest: config/step_plan.py
        host_optimizer_threads(self.host_optimizer_threads)
        if self.cpu_offload_layers is None:
            if self.device_memory_budget is not None:
                raise ConfigError("--device-memory-budget is used only with --cpu-offload-layers auto")
            return
        spec = parse_layer_spec(self.cpu_offload_layers, num_layers)
        if spec.kind == "auto" and self.device_memory_budget is None:
            raise ConfigError("--cpu-offload-layers auto needs --device-memory-budget (e.g. 30GiB)")
        if spec.kind != "auto" and self.device_memory_budget is not None:
            raise ConfigError(
                "--device-memory-budget is used only with --cpu-offload-layers auto, "
                f"got --cpu-offload-layers {self.cpu_offload_layers!r}"
            )
        if self.device_memory_budget is not None:
            parse_memory_size(self.device_memory_budget)


def parse_memory_size(text: str) -> int:
    """'30GiB' / '512MiB' / '40GB' / '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"--device-memory-budget {text!r}: expected a size such as 30GiB, 512MiB, 40GB or a number of bytes"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_offload_what(text: str) -> frozenset:
    """--cpu-offload-what: params,grads,optimizer (the layer lives on host) or optimizer (only
    its AdamW moments do; ZeRO-Offload for the chosen layers).

    A gradient is produced on its weight's device, so weights and gradients move together,
    and a host-resident weight is updated where it lives, so they bring the optimizer along.
    """
    items = frozenset(x.strip() for x in (text or "").split(",") if x.strip())
    unknown = sorted(items - FULL)
    if unknown or not items:
        raise ConfigError(
            f"--cpu-offload-what {text!r}: expected a comma-separated subset of "
            f"{','.join(WHAT_ITEMS)}, got {unknown or 'nothing'}"
        )
    if items not in (FULL, OPTIMIZER_ONLY):
        raise ConfigError(
            f"--cpu-offload-what {text!r}: use params,grads,optimizer (weights, gradients and AdamW "
            "state on host: a gradient is produced where its weight lives, and a host weight is "
            "updated on host) or optimizer (AdamW state only)"
        )
    return items


@dataclass(frozen=True)
class LayerSpec:
    """A parsed --cpu-offload-layers: kind is count | fraction | list | auto."""

    kind: str
    count: int = 0
    fraction: float = 0.0
    layers: Tuple[int, ...] = ()


def parse_layer_spec(spec: str, num_layers: int) -> LayerSpec:
    flag = f"--cpu-offload-layers {spec!r}"
    text = spec.strip()
    if text == "auto":
        return LayerSpec("auto")
    if "," in text:
        try:
            layers = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"{flag}: a list holds global layer indices, as in 1,5,7 (one layer: '5,')") from None
        bad = [i for i in layers if not 0 <= i < num_layers]
        if not layers or bad:
            raise ConfigError(f"{flag}: layer indices must be in [0, {num_layers}) (--num-layers), got {list(bad)}")
        if len(set(layers)) != len(layers):
            raise ConfigError(f"{flag}: a layer index appears twice")
        return LayerSpec("list", layers=tuple(sorted(layers)))
    if "." in text:
        try:
            fraction = float(text)
        except ValueError:
            fraction = -1.0
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"{flag}: a fraction of each stage's layers must be between 0 and 1")
        return LayerSpec("fraction", fraction=fraction)
    try:
        count = int(text)
    except ValueError:
        raise ConfigError(
            f"{flag}: expected a count N (the last N layers of each stage), a fraction such as "
            "0.25, a list of layer indices such as 1,5,7, or auto"
        ) from None
    if not 0 <= count <= num_layers:
        raise ConfigError(f"{flag}: a count must be between 0 and --num-layers ({num_layers})")
    return LayerSpec("count", count=count)


def host_optimizer_threads(value: str, cores: Optional[int] = None, local_ranks: Optional[int] = None) -> int:
    """--host-optimizer-threads as a count: N, or ``auto``: ``cores`` (default: the CPUs this
    process may run on) divided by ``local_ranks`` (default: torchrun's LOCAL_WORLD_SIZE, else 1),
    at least 1 — each rank of a node gets its share, as ZeRO-Offload sizes its CPU Adam."""
    if str(value) == "auto":
        cores = len(os.sched_getaffinity(0)) if cores is None else cores
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_ranks is None else local_ranks
        return max(1, cores // max(1, local_ranks))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= LAYERS:
        raise ConfigError(f"--host-optimizer-threads: expected auto or a count in [1, {LAYERS}], got {value!r}")
    return threads


# Type and range of every numeric field (config/ranges.py).
RANGES = {"offload_prefetch": at_least(0, LAYERS), "cpu_offload_delayed_param_update_warmup_steps": at_least(0)}
