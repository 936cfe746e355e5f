"""The host optimizer step's time: the bytes its kernel moves per element (``optim/traffic.py``)
over the bandwidth one rank's threads get, min(threads x one thread's rate, the node's DRAM
bandwidth over its ranks, shared with the offload copies and NVMe traffic of the same
iteration). The node's figures come from a GPU preset's node (``hardware.HOST_PRESETS``: sourced
and assumed) or from ``benchmarks/host_optimizer.py --json`` run on the user's own host
(``load_calibration``: measured); each figure keeps its provenance for the plan's output."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Dict, Optional, Tuple, Union

from megatron_p2r.config import Config, ConfigError
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.optim.traffic import BYTES, kernel_bytes_per_element
from megatron_p2r.planning.hardware import HostSpec

MOMENT_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",), "adafactor": ()}
# (optimizer, main, grad, ((moment, dtype), ...), weight): one host-step kernel setting, as the
# benchmark's rows name it
Setting = Tuple[str, str, str, Tuple[Tuple[str, str], ...], Optional[str]]


def step_setting(cfg: Config, plan: ParallelPlan) -> Setting:
    """The kernel setting ``cfg``'s optimizer steps with: the weight is rounded from the main in
    the same pass unless the main is the weight itself (fp32 weights; fp16 weights as their own mains)."""
    b = plan.buffers
    moments = tuple(zip(MOMENT_NAMES[cfg.train.optimizer], cfg.train.moment_dtypes, strict=True))
    return (
        cfg.train.optimizer,
        b.main_params_dtype,
        b.main_grads_dtype,
        moments,
        b.params_dtype if b.master_bytes else None,
    )


def setting_bytes(setting: Setting) -> int:
    optimizer, main, grad, moments, weight = setting
    return kernel_bytes_per_element(optimizer, main, grad, dict(moments), weight)


def describe_setting(setting: Setting) -> str:
    optimizer, main, grad, moments, weight = setting
    parts = [f"{optimizer}", f"main {main}", f"grad {grad}", *(f"{k} {v}" for k, v in moments)]
    return ", ".join(parts + ([f"weight {weight}"] if weight else []))


def _field(data: dict, key: str, kind, path: str, where: str = ""):
    if key not in data:
        raise ConfigError(f"--host-calibration {path}: '{where}{key}' missing")
    value = data[key]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and isinstance(value, (int, float)):
        ok = math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(
            f"--host-calibration {path}: '{where}{key}' must be a positive {kind.__name__ if isinstance(kind, type) else 'number'}, "
            f"got {value!r}"
        )
    return value


def _row_setting(row: dict, path: str, where: str) -> Setting:
    optimizer = _field(row, "optimizer", str, path, where)
    if optimizer not in MOMENT_NAMES:
        raise ConfigError(
            f"--host-calibration {path}: '{where}optimizer' must be adam, lion or adafactor, got {optimizer!r}"
        )
    dtypes = [_field(row, k, str, path, where) for k in ("main", "grad")]
    moments = row.get("moments") or {}
    weight = row.get("weight")
    for value in [*dtypes, *moments.values(), *([weight] if weight is not None else [])]:
        if value not in BYTES:
            raise ConfigError(f"--host-calibration {path}: {where}: dtype {value!r} is not one of {sorted(BYTES)}")
    ordered = tuple((name, moments[name]) for name in MOMENT_NAMES[optimizer] if name in moments)
    return optimizer, dtypes[0], dtypes[1], ordered, weight


def load_calibration(path: str) -> HostSpec:
    """The host of ``benchmarks/host_optimizer.py --json`` (``path``): its cores, its DRAM
    bandwidth (the all-threads triad, or the fastest kernel of the file where one streamed faster:
    a triad written in torch is not the machine's best stream), one thread's rate (the 1-thread triad, for settings the
    file has no row of) and, per kernel setting, one thread's measured rate (its 1-thread row's
    bytes per element over its ns per element)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"--host-calibration {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--host-calibration {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--host-calibration {path}: expected a JSON object (benchmarks/host_optimizer.py --json)")
    cores = _field(data, "cores", int, path)
    triad = _field(data, "triad_gbs", dict, path)
    threads = {}
    for key, gbs in triad.items():
        if not key.isdigit() or int(key) < 1:
            raise ConfigError(f"--host-calibration {path}: 'triad_gbs' keys are thread counts, got {key!r}")
        threads[int(key)] = _field(triad, key, (int, float), path, "triad_gbs.")
    if 1 not in threads:
        raise ConfigError(f"--host-calibration {path}: 'triad_gbs' needs the 1-thread triad (key \"1\")")
    most = max(threads)
    rates: Dict[Setting, float] = {}
    fastest = 0.0  # bytes/s of the fastest kernel row at any thread count
    for i, row in enumerate(data.get("results") or []):
        where = f"results[{i}]."
        setting = _row_setting(row, path, where)
        rate = setting_bytes(setting) / _field(row, "ns_per_element", (int, float), path, where) * 1e9
        fastest = max(fastest, rate)
        if _field(row, "threads", int, path, where) == 1:
            rates[setting] = rate
    dram, dram_source = threads[most] * 1e9, f"measured: {path}, triad at {most} threads"
    if fastest > dram:
        dram, dram_source = fastest, f"measured: {path}, its fastest kernel (above its {most}-thread triad)"
    cpu = data.get("cpu", "?")
    return HostSpec(
        f"calibration {path}",
        cores,
        dram,
        threads[1] * 1e9,
        setting_bw=rates,
        sources={
            "cores": f"measured: {path} ({cpu})",
            "dram_bw": dram_source,
            "setting_bw": f"measured: {path}, its 1-thread row",
            "thread_bw": f"measured: {path}, 1-thread triad (for a setting without a 1-thread row: the kernel "
            f"assumed at its memory bound)",
        },
    )


def with_overrides(
    host: HostSpec, cores: Optional[int] = None, dram_bw: Optional[float] = None, thread_bw: Optional[float] = None
) -> HostSpec:
    """``host`` with the figures given on the command line (--host-cores, --host-dram-bw,
    --host-thread-bw), each marked as given; a given thread rate applies to every setting."""
    given = {k: v for k, v in (("cores", cores), ("dram_bw", dram_bw), ("thread_bw", thread_bw)) if v is not None}
    if not given:
        return host
    flags = {"cores": "--host-cores", "dram_bw": "--host-dram-bw", "thread_bw": "--host-thread-bw"}
    sources = {**host.sources, **{k: f"given: {flags[k]}" for k in given}}
    rates = {} if thread_bw is not None else host.setting_bw
    return dataclasses.replace(host, **given, setting_bw=rates, sources=sources)


def threads_per_rank(configured: Union[int, str, None], host: HostSpec, ranks_per_node: int) -> Tuple[float, str]:
    """(threads one rank's host step uses, why): ``--host-optimizer-threads`` (``auto``: the
    node's cores over its ranks), at most the rank's share of the cores."""
    share = host.cores / ranks_per_node
    if configured is None or str(configured) == "auto":
        return max(share, 1.0), f"auto: {host.cores} cores / {ranks_per_node} ranks per node"
    configured = int(configured)
    if configured > share:
        return share, f"--host-optimizer-threads {configured}, capped at {host.cores} cores / {ranks_per_node} ranks"
    return float(configured), f"--host-optimizer-threads {configured}"


def host_bandwidth(
    setting: Setting,
    host: HostSpec,
    threads: Tuple[float, str],
    ranks_per_node: int,
    step_bytes: float,
    other_bytes: float,
    given_bw: Optional[float] = None,
) -> dict:
    """The bytes/s one rank's host step streams, with its inputs and their provenance:
    min(threads x one thread's rate for ``setting``, the rank's share of the node's DRAM left by
    ``other_bytes``). The DRAM carries, while the step runs, the step's ``step_bytes`` and the
    rank's traffic that runs beside it (``other_bytes``: NVMe reads and writes; the offload copies
    of the iteration under the overlapped and delayed steps, which run beside the next fetches),
    all ranks of the node at once. ``given_bw`` (--host-optimizer-bw) replaces it."""
    n, why = threads
    if setting in host.setting_bw:
        rate, rate_source = host.setting_bw[setting], f"{host.sources['setting_bw']} ({describe_setting(setting)})"
    else:
        rate, rate_source = host.thread_bw, host.sources.get("thread_bw", "assumed")
    share = host.dram_bw / ranks_per_node
    dram = share * step_bytes / (step_bytes + other_bytes) if step_bytes else share
    bw, limit = min(n * rate, dram), ("threads" if n * rate <= dram else "dram")
    if given_bw is not None:
        bw, limit = given_bw, "given: --host-optimizer-bw"
    return {
        "bw": bw,
        "limit": limit,
        "setting": describe_setting(setting),
        "bytes_per_element": setting_bytes(setting),
        "threads": n,
        "threads_source": why,
        "thread_bw": rate,
        "thread_bw_source": rate_source,
        "node": host.name,
        "cores": host.cores,
        "cores_source": host.sources.get("cores", "assumed"),
        "dram_bw": host.dram_bw,
        "dram_bw_source": host.sources.get("dram_bw", "assumed"),
        "ranks_per_node": ranks_per_node,
        "dram_share": dram,
        "other_dram_bytes": other_bytes,
    }
