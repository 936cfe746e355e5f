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
on local NVMe (``offload/nvme.py``). The offload manager and the DDP, built before the optimizer,
reach its host step through a ``HostStepLink`` (``host_step_link``) that the optimizer connects.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional

from torch import nn

from megatron_p2r.config import StepPlan
from megatron_p2r.offload.nvme import NvmeOptimizerState, NvmeStateFile, region_bytes
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.host_step import HostStepLink, HostStepper
from megatron_p2r.optim.mixed_precision import HostStepSettings


def optimizer_placement(manager: OffloadManager) -> Dict[int, str]:
    """id(parameter) -> "host" | "staged" for every parameter of an offloaded layer."""
    where = "host" if "params" in manager.what else "staged"
    return {pid: where for pid in manager.offloaded_param_ids}


def host_step_link(
    model: nn.Module, steps: StepPlan, module_bytes: Dict[Optional[int], Dict[str, int]], rank: int
) -> HostStepLink:
    """The link the offload manager and the DDP are built with, before the optimizer that
    connects it: the DDP reports buckets to an early step; with an NVMe path, the step's mains
    and state move to the file once the step is built (``module_bytes``: the plan's, per layer)."""
    early = steps.host_step(model.layer_keys) == "early"
    nvme = (
        None if steps.nvme_path is None else functools.partial(_nvme_state, steps.nvme_path, rank, module_bytes, early)
    )
    return HostStepLink(starts_in_backward=early, make_nvme=nvme)


def _nvme_state(
    directory: str,
    rank: int,
    module_bytes: Dict[Optional[int], Dict[str, int]],
    early: bool,
    host: HostStepper,
    layers: Dict[int, list],
) -> NvmeOptimizerState:
    regions = {key: region_bytes(module_bytes[key]["optimizer"], len(shards)) for key, shards in layers.items()}
    order = list(layers)[::-1] if early else list(layers)  # as the layers' steps start
    return NvmeOptimizerState(
        NvmeStateFile(directory, rank, regions), host.inner, layers, order, list(host.by_layer.values())
    )


def host_step_settings(manager: OffloadManager, steps: StepPlan) -> HostStepSettings:
    """How the host placement steps: the step plan's ``host_step`` for this stage's layers,
    connected through the manager's link."""
    return HostStepSettings(
        steps.host_step(manager.model.layer_keys) or "serial",
        manager.forward_layers,
        by_layer=steps.nvme_path is not None,
        delay_after=steps.delay_warmup,
        link=manager.host_step,
    )
