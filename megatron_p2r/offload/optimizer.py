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

from typing import Dict

from megatron_p2r.config import StepPlan
from megatron_p2r.offload.nvme import NvmeOptimizerState, NvmeStateFile, region_bytes
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.mixed_precision import HostStepSettings, MixedPrecisionOptimizer


def optimizer_placement(manager: OffloadManager) -> Dict[int, str]:
    """id(parameter) -> "host" | "staged" for every parameter of an offloaded layer."""
    where = "host" if "params" in manager.what else "staged"
    return {pid: where for pid in manager.offloaded_param_ids}


def host_step_settings(manager: OffloadManager, steps: StepPlan) -> HostStepSettings:
    """How the host placement steps: the step plan's ``host_step`` for this stage's layers."""
    return HostStepSettings(steps.host_step(manager.model.layer_keys) or "serial", manager.forward_layers,
                            by_layer=steps.nvme_path is not None,
                            delay_after=steps.delay_warmup)


def finish_host_optimizer(optimizer: MixedPrecisionOptimizer, manager: OffloadManager, steps: StepPlan,
                          rank: int) -> None:
    """Connect the built optimizer's host step to the offload: each layer's fetch waits for that
    layer's step; with an NVMe path, the step's mains and state move to the file."""
    host = optimizer.host
    if host is None:
        return
    manager.step_done = host.wait
    if steps.nvme_path is None:
        return
    layers = {key: [ms for ms in optimizer.shards if ms.placement == "host" and id(ms.param) in ids]
              for key, ids in manager.forward_layers.items()}
    regions = {key: region_bytes(manager.module_bytes[key]["optimizer"], len(shards)) for key, shards in layers.items()}
    file = NvmeStateFile(steps.nvme_path, rank, regions)
    early = steps.host_step(manager.model.layer_keys) == "early"
    order = list(layers)[::-1] if early else list(layers)   # as the layers' steps start
    manager.nvme = NvmeOptimizerState(file, host.inner, layers, order, list(host.by_layer.values()))
