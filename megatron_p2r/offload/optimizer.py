"""Where the optimizer keeps the state of offloaded layers.

With ``--cpu-offload-what params,grads,optimizer`` a layer's weights live on host, so its fp32
main parameters, AdamW moments and step do too ("host": a host AdamW, issued after the device
step so the two overlap on CUDA, once the fetches that read the weights are done). With
``--cpu-offload-what optimizer`` only the moments do ("staged": ``optim.optimizer.StagedOptimizer``
steps host copies). Under the distributed optimizer these are the rank's shards of them.
"""
from __future__ import annotations

from typing import Dict

from megatron_p2r.offload.runtime import OffloadManager


def optimizer_placement(manager: OffloadManager) -> Dict[int, str]:
    """id(parameter) -> "host" | "staged" for every parameter of an offloaded layer."""
    where = "host" if "params" in manager.what else "staged"
    return {pid: where for pid in manager.offloaded_param_ids}
