"""Where the optimizer keeps the state of offloaded layers.

With ``--cpu-offload-what params,grads,optimizer`` a layer's weights live on host, so its fp32
main parameters, AdamW moments and step do too ("host": a host AdamW, issued after the device
step so the two overlap on CUDA, once the fetches that read the weights are done). With
``--cpu-offload-what optimizer`` only the moments do ("staged": ``optim.optimizer.StagedOptimizer``
steps host copies). Under the distributed optimizer these are the rank's shards of them.
``--overlap-cpu-optimizer-d2h-h2d`` runs the host step on worker threads instead
(``optim/host_step.py``), layer by layer in the order the forward fetches the layers.
"""
from __future__ import annotations

from typing import Dict, Optional

from megatron_p2r.config import Config, host_step_starts_in_backward
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.mixed_precision import HostStepSettings


def optimizer_placement(manager: OffloadManager) -> Dict[int, str]:
    """id(parameter) -> "host" | "staged" for every parameter of an offloaded layer."""
    where = "host" if "params" in manager.what else "staged"
    return {pid: where for pid in manager.offloaded_param_ids}


def overlapped_host_step(manager: OffloadManager, cfg: Config) -> Optional[HostStepSettings]:
    """How to overlap the host step (--overlap-cpu-optimizer-d2h-h2d), None without it."""
    if not cfg.offload.overlap_cpu_optimizer_d2h_h2d:
        return None
    return HostStepSettings(manager.forward_layers, cfg.offload.host_optimizer_threads,
                            host_step_starts_in_backward(cfg.train, manager.model.layer_keys))
