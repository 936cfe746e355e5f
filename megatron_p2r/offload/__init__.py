"""Granular CPU offloading (the M6-10T paper's second technique): chosen transformer layers keep
their weights, gradients and optimizer state (fp32 mains and AdamW moments) in host memory.

Unlike offloading everything (ZeRO-Offload), only a subset of layers — chosen per stage by the
``ParallelPlan`` (``layout.offload``) — lives on host; the rest of the rank stays on the
device. Applied to a built model, as each parallelism is: ``apply_offload`` moves the resident
part to the device, pins the offloaded weights and makes the model call offloaded layers
through the fetch runtime (``runtime``); ``optimizer.optimizer_placement`` tells the optimizer
to step the offloaded parameters on host. See docs/offload.md.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from megatron_p2r.config import OffloadConfig, parse_offload_what
from megatron_p2r.offload.runtime import OffloadManager
from megatron_p2r.optim.host_step import HostStepLink
from megatron_p2r.parallel.state import ParallelState


def build_device(o: OffloadConfig, ps: ParallelState) -> torch.device:
    """Where to build and initialise the stage: on host when layer weights will live there, so
    a stage that does not fit on the device is never materialised there (init is device-invariant)."""
    if o.cpu_offload_layers is not None and "params" in parse_offload_what(o.cpu_offload_what):
        return torch.device("cpu")
    return ps.device


def apply_offload(
    model: torch.nn.Module,
    keys: Sequence[int],
    o: OffloadConfig,
    ps: ParallelState,
    module_bytes: Dict[Optional[int], Dict[str, int]],
    delayed_update: bool = False,
    host_step: Optional[HostStepLink] = None,
) -> OffloadManager:
    """Put the modules ``keys`` of ``model`` (built on ``build_device``) on host, the rest on the
    device; ``module_bytes`` is this rank's accounting (``ParallelPlan.module_state_bytes``);
    ``delayed_update``: the step plan's host step is delayed (config/step_plan.py); ``host_step``:
    its link, on which each fetch waits (``optimizer.host_step_link``)."""
    what = parse_offload_what(o.cpu_offload_what)
    if "params" in what and ps.device.type != "cpu":
        offloaded = {id(p) for k in keys for p in model.layers[str(k)].parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.pin_memory() if id(p) in offloaded else p.data.to(ps.device)
            for module in model.modules():
                for name, b in module.named_buffers(recurse=False):
                    module._buffers[name] = b.to(ps.device)
    return OffloadManager(model, keys, ps, o.offload_prefetch, what, module_bytes, delayed_update, host_step)
