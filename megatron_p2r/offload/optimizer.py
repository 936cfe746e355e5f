"""Where the optimizer keeps the state of offloaded layers.

With ``--cpu-offload-what params,grads,optimizer`` a layer's weights live on host, so its fp32
main parameters, AdamW moments and step do too ("host": a host AdamW, issued after the device
step so the two overlap on CUDA, once the fetches that read the weights are done). With
``--cpu-offload-what optimizer`` only the moments do ("staged": ``optim.optimizer.StagedOptimizer``
steps host copies). Under the distributed optimizer these are the rank's shards of them.
``--overlap-cpu-optimizer-d2h-h2d`` runs the host step on worker threads instead
(``optim/host_step.py``), layer by layer in the order the forward fetches the layers;
``--cpu-offload-delayed-param-update`` one iteration late (``optim/delayed_update.py``).
``--cpu-offload-optimizer-nvme-path`` keeps the host step's fp32 mains and state in a mapped file
on local NVMe (``offload/nvme.py``).
"""
from __future__ import annotations

from typing import Dict, Optional

from megatron_p2r.config import Config, host_step_starts_in_backward
from megatron_p2r.config.offload import host_optimizer_threads
from megatron_p2r.offload.nvme import LayerByLayer, NvmeOptimizerState, NvmeStateFile, region_bytes
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.delayed_update import DelayedHostStep
from megatron_p2r.optim.host_step import HostStep
from megatron_p2r.optim.mixed_precision import HostStepSettings, MixedPrecisionOptimizer


def optimizer_placement(manager: OffloadManager) -> Dict[int, str]:
    """id(parameter) -> "host" | "staged" for every parameter of an offloaded layer."""
    where = "host" if "params" in manager.what else "staged"
    return {pid: where for pid in manager.offloaded_param_ids}


def overlapped_host_step(manager: OffloadManager, cfg: Config) -> Optional[HostStepSettings]:
    """How to overlap the host step (--overlap-cpu-optimizer-d2h-h2d), None without it."""
    if not cfg.offload.overlap_cpu_optimizer_d2h_h2d:
        return None
    o = cfg.offload
    if o.cpu_offload_delayed_param_update:   # the step has the next iteration: none starts in backward
        return HostStepSettings(manager.forward_layers, host_optimizer_threads(o.host_optimizer_threads),
                                delay_after=o.cpu_offload_delayed_param_update_warmup_steps)
    return HostStepSettings(manager.forward_layers, host_optimizer_threads(o.host_optimizer_threads),
                            host_step_starts_in_backward(cfg.train, manager.model.layer_keys))


def finish_host_optimizer(optimizer: MixedPrecisionOptimizer, manager: OffloadManager, cfg: Config, rank: int) -> None:
    """Connect the built optimizer's host step to the offload: each layer's fetch waits for that
    layer's overlapped step; with an NVMe path, the step's mains and state move to the file."""
    host = optimizer.inner.get("host")
    if isinstance(host, HostStep):
        manager.step_done = host.wait
        manager.delayed_update = isinstance(host, DelayedHostStep)
    if host is None or cfg.offload.cpu_offload_optimizer_nvme_path is None:
        return
    inner = host.inner if isinstance(host, HostStep) else host
    layers = {key: [ms for ms in optimizer.shards if ms.placement == "host" and id(ms.param) in ids]
              for key, ids in manager.forward_layers.items()}
    regions = {key: region_bytes(manager.module_bytes[key]["optimizer"], len(shards)) for key, shards in layers.items()}
    file = NvmeStateFile(cfg.offload.cpu_offload_optimizer_nvme_path, rank, regions)
    order = list(layers)[::-1] if isinstance(host, HostStep) and host.early else list(layers)   # as steps start
    manager.nvme = NvmeOptimizerState(file, inner, layers, order)
    if not isinstance(host, HostStep):
        optimizer.inner["host"] = LayerByLayer(inner, layers)
