"""What a run holds (``TrainState``: what a checkpoint saves and a resume restores), built in
dependency order: the model, its offload, the gradient buffers, the optimizer per placement."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from megatron_p2r import offload
from megatron_p2r.config import Config, build_step_plan
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.model.m6 import M6Model, build_model
from megatron_p2r.offload.optimizer import host_step_link, host_step_settings, optimizer_placement
from megatron_p2r.optim import host_kernels
from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.optim.mixed_precision import MixedPrecisionOptimizer, build_mixed_precision_optimizer
from megatron_p2r.optim.scheduler import LRScheduler
from megatron_p2r.parallel.ddp import DistributedDataParallel
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training.timers import Timers


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps); a checkpoint was saved."""


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint saves and a resume restores."""

    cfg: Config
    ps: ParallelState
    plan: ParallelPlan
    model: M6Model
    ddp: DistributedDataParallel  # gradient buffers and their reduction
    optimizer: MixedPrecisionOptimizer
    scheduler: LRScheduler
    scaler: LossScaler
    iteration: int = 0
    consumed_samples: int = 0
    skipped_in_a_row: int = 0
    offload: Optional[offload.OffloadManager] = None  # when --cpu-offload-layers is set
    timers: Timers = dataclasses.field(default_factory=lambda: Timers(0, torch.device("cpu")))  # --timing-log-level

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return list(self.model.parameters())


def build_train_state(cfg: Config, ps: ParallelState, plan: Optional[ParallelPlan] = None) -> TrainState:
    """The model (16-bit weights with --bf16/--fp16), its offload, gradient buffers and optimizer."""
    plan = plan or ParallelPlan.build(cfg, ps.layout)
    model = build_model(cfg, ps, plan, device=offload.build_device(cfg.offload, ps))
    if cfg.train.compile:
        from megatron_p2r.model.compiled import compile_layers  # imports torch._dynamo: seconds, only when asked

        compile_layers(model.layers)
    manager, link, steps = None, None, build_step_plan(cfg)  # steps: how each placement's optimizer steps
    if cfg.offload.cpu_offload_layers is not None:  # chosen layers' weights, grads and optimizer state on host
        module_bytes = plan.module_state_bytes(ps.pp_rank, ps.coords)
        # fetches wait for the host step and an early one hears of buckets: through a link the optimizer connects
        link = host_step_link(model, steps, module_bytes, ps.rank)
        manager = offload.apply_offload(
            model,
            plan.stage(ps.pp_rank).offloaded,
            cfg.offload,
            ps,
            module_bytes,
            delayed_update=steps.delayed,
            host_step=link,
        )
    p = cfg.parallel
    ddp = DistributedDataParallel(
        model,
        plan,
        ps,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        fetched=manager.fetched_param_ids if manager else (),
        waits_whole=model.layers.values() if cfg.train.compile else (),
        reduction_started=link.reduction_started if link and link.starts_in_backward else None,
    )
    host_step = host_step_settings(manager, steps) if manager else None
    host_kernels.set_threads(steps.threads)
    optimizer = build_mixed_precision_optimizer(
        ddp,
        plan,
        ps,
        cfg.train,
        optimizer_placement(manager) if manager else None,
        manager.synchronize if manager else None,
        host_step,
    )
    return TrainState(
        cfg=cfg,
        ps=ps,
        plan=plan,
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=LRScheduler(optimizer, cfg, ps.layout.world_size),
        scaler=LossScaler(cfg.train),
        offload=manager,
        timers=Timers(cfg.logging.timing_log_level, ps.device),
    )


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(st.data_ptr(), t.device)] = st.nbytes()
    return sum(seen.values())


def describe_memory(state: TrainState) -> dict:
    """Parameter count and the bytes this rank holds, measured from the tensors (tensor
    accounting): weights, gradient buffers, optimizer state (fp32 mains that are copies of
    16-bit weights, the optimizer's state; empty until the first step)."""
    params = state.params
    opt = state.optimizer
    mains = [ms.main for ms in opt.shards if not ms.aliases_param]
    moments = [v for inner in opt.inner.values() for s in inner.state.values() for k, v in s.items() if k != "step"]
    return {
        "rank": state.ps.rank,
        "parameters": sum(p.numel() for p in params),
        "param_bytes": _storage_bytes(params),
        "grad_bytes": _storage_bytes(state.ddp.buffer_tensors("grads")),
        "optimizer_bytes": _storage_bytes(mains) + _storage_bytes(moments),
    }
