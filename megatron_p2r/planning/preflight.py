"""Before a model is built: does the run fit in the memory this machine has?

The planner's own accounting (parameters, gradients, AdamW moments, what offload keeps on host,
the activations of the micro-batches the schedule keeps in flight -- for the attention kernel
that will run: on CPU with attention dropout SDPA's math kernel and its s x s tensors --, the
micro-batches of a step or an evaluation, the dataset's sample indices, and the runtime a
process still loads after the check) is summed over the ranks that share this host and
compared with the memory the host has available (``MemAvailable``, or the headroom of the
tightest memory cgroup above the process when lower: ``planning.host_memory``); on CUDA each
rank's device part is also compared with its device's free memory. An absurd size
(``--seq-length 10000000``, ``--hidden-size 100000``) then fails at once with one line, "needs
at least 38.0 GiB of host memory, the machine has 24.0 GiB available", instead of tens of
seconds of allocation and an out-of-memory kill. On CPU the estimate is within 25% of the
anonymous memory a run takes after the check (docs/reliability.md has the table and the
command). ``P2R_SKIP_MEMORY_CHECK=1`` skips the check (an estimate that is wrong for some model
should never block a run).
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from megatron_p2r.config import Config, ConfigError, global_batch_size, num_microbatches, train_samples
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.activations import activation_memory, sinks_unmodelled
from megatron_p2r.planning.hardware import GiB
from megatron_p2r.planning.host_memory import available_host_memory
from megatron_p2r.planning.memory import offload_plan

SKIP_ENV = "P2R_SKIP_MEMORY_CHECK"
INDEX_BYTES_PER_SAMPLE = 20  # sample_idx (2 x int32 or int64) + shuffle_idx + a share of doc_idx
BATCH_BYTES_PER_TOKEN = 12  # int64 token (inputs and labels are views of it) + fp32 loss mask
# What a process still allocates after the check whatever the model: torch 2.13's first AdamW
# imports torch._dynamo (~70 MiB of Python objects), and kernels set up buffers on first use.
# Measured: the peak of ``benchmarks/preflight_memory.py --seq 64`` exceeds the rest of the
# estimate by 70-76 MiB.
RUNTIME_BYTES = 80 * 2**20


def batch_bytes(cfg: Config, world_size: int) -> int:
    """The micro-batches a rank holds at once: a step's (the schedules take them all), or an
    evaluation's (``--eval-iters`` steps' worth) when the run evaluates."""
    m, t = cfg.model, cfg.train
    steps = cfg.logging.eval_iters if (cfg.logging.evaluates or cfg.logging.eval_only) else 1
    return (
        num_microbatches(cfg, world_size)
        * t.micro_batch_size
        * (m.seq_length + 1)
        * BATCH_BYTES_PER_TOKEN
        * max(steps, 1)
    )


def rank_memory(cfg: Config, plan: ParallelPlan, stage: int, device_type: str) -> Dict[str, int]:
    """Bytes a rank of ``stage`` needs on its device and on the host (on CPU: all on the host)."""
    off = offload_plan(cfg, plan, stage)
    # The CPU estimate does not model attention sinks' math kernel; the CUDA one is a lower bound.
    kind = "cuda" if sinks_unmodelled(cfg.model, device_type) else device_type
    act = activation_memory(cfg, plan, stage, offloaded=off["recomputed"], device_type=kind)
    device = (
        sum(off["device"].values()) + act["activations"] + act["transient"] + batch_bytes(cfg, plan.layout.world_size)
    )
    host = sum(off["host"].values()) + RUNTIME_BYTES
    if not cfg.data.mock_data:
        world = plan.layout.world_size
        host += INDEX_BYTES_PER_SAMPLE * (
            train_samples(cfg, world) + global_batch_size(cfg, world) * cfg.logging.eval_iters
        )
    return {"device": device, "host": host} if device_type == "cuda" else {"device": 0, "host": host + device}


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def check_memory(
    cfg: Config,
    plan: ParallelPlan,
    rank: int,
    device_type: str,
    device_free: Optional[int] = None,
    host_available: Optional[int] = None,
) -> None:
    """ConfigError when the ranks on this host (torchrun's LOCAL_WORLD_SIZE, consecutive ranks)
    need more host memory than it has, or this rank more device memory than is free."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    layout = plan.layout
    local = max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), layout.world_size))
    first = rank - rank % local
    host_ranks = range(first, min(first + local, layout.world_size))
    needs = {s: rank_memory(cfg, plan, s, device_type) for s in {layout.coords(r).pp for r in host_ranks}}
    host_need = sum(needs[layout.coords(r).pp]["host"] for r in host_ranks)
    available = available_host_memory() if host_available is None else host_available
    hint = f" (set {SKIP_ENV}=1 to skip this estimate)"
    if available is not None and host_need > available:
        who = f"its {len(host_ranks)} ranks on this host need" if len(host_ranks) > 1 else "it needs"
        raise ConfigError(
            f"this run does not fit in memory: {who} at least {_size(host_need)} of host memory "
            "(parameters, gradients, optimizer state, activations, micro-batches, data indices, runtime), the "
            f"machine has {_size(available)} available; reduce the model, --seq-length, "
            f"--micro-batch-size or --global-batch-size, or use more ranks{hint}"
        )
    device_need = needs[layout.coords(rank).pp]["device"]
    if device_free is not None and device_need > device_free:
        raise ConfigError(
            f"this run does not fit on the device: rank {rank} needs at least {_size(device_need)}, "
            f"{_size(device_free)} of device memory is free{hint}"
        )
