"""Megatron-LM's optional training diagnostics: the parameters' norm (--log-params-norm), the
zeros in the gradient (--log-num-zeros-in-grad), memory figures (--log-memory-to-tensorboard),
the validation perplexity (--log-validation-ppl-to-tensorboard) and the scalars TensorBoard gets
every --tensorboard-log-interval iterations, under Megatron's own tag names.

Norm and zeros count each logical element once over all ranks, by the plan's ownership of each
optimizer shard (``MainShard.in_norm``, the grad norm's): a tensor replicated over TP, DP, the
stages that share a pseudo slot or the tied embedding is counted on one rank only.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_p2r.metrics import TrainingLogger, peak_memory_bytes
from megatron_p2r.optim.mixed_precision import MixedPrecisionOptimizer
from megatron_p2r.parallel.grads import grad_norm_and_non_finite
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training.state import TrainState

PPL_LOSS_CAP = 20.0  # Megatron-LM's: exp(min(20, loss)), so an early loss does not overflow the plot


def params_norm(optimizer: MixedPrecisionOptimizer, ps: ParallelState) -> float:
    """The L2 norm of all the model's parameters over all ranks, from the fp32 main weights (the
    16-bit copies' source, as Megatron-LM reads ``main_param``). A collective of every rank.
    An overlapped host step still writing its layers' weights is waited for first."""
    optimizer.finish_host_step()
    norm, _ = grad_norm_and_non_finite([ms.main for ms in optimizer.shards], optimizer.norm_mask, ps)
    return norm


def num_zeros_in_grad(optimizer: MixedPrecisionOptimizer, ps: ParallelState) -> int:
    """How many elements of the whole (reduced) gradient are exactly zero, each counted once over
    all ranks. A collective of every rank."""
    count = torch.zeros(1, device=ps.device, dtype=torch.float64)  # exact up to 2**53 elements
    for ms in optimizer.shards:
        if ms.in_norm:
            count += (ms.grad == 0).sum().to(count.device)
    if ps.layout.world_size > 1:
        dist.all_reduce(count)
    return int(count.item())


def validation_ppl(loss: float) -> float:
    return math.exp(min(PPL_LOSS_CAP, loss))


def _resident_bytes() -> Optional[int]:
    """This process's resident memory now (Linux's /proc; None where it is not there)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_scalars(device: torch.device) -> Dict[str, float]:
    """Megatron-LM's memory tags from the CUDA allocator's statistics; on CPU, where there is no
    allocator to ask, the process's resident memory now and at its peak."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"],
        }
    now = _resident_bytes()
    return {**({"mem-rss-bytes": now} if now is not None else {}), "mem-max-rss-bytes": peak_memory_bytes(device)}


def step_scalars(
    out: dict, lr: float, loss_scale: float, norm: Optional[float], memory: Optional[Dict[str, float]]
) -> Dict[str, float]:
    """One step's TensorBoard scalars under Megatron-LM's tags (its ``training_log``): the step's
    own loss, not the interval's mean. A skipped step has no grad norm, as there."""
    scalars = {"learning-rate": lr, "batch-size": out["global_batch_size"], "lm loss": out["lm_loss"]}
    scalars["loss-scale"] = loss_scale
    if not out["skipped"]:
        scalars["grad-norm"] = out["grad_norm"]
    if out.get("num_zeros_in_grad") is not None:
        scalars["num-zeros"] = out["num_zeros_in_grad"]
    if norm is not None:
        scalars["params-norm"] = norm
    return {**scalars, **(memory or {})}


def after_step(state: TrainState, out: dict, lr: float, logger: TrainingLogger) -> Optional[float]:
    """After each step, on every rank: the parameters' norm when this iteration's log record or
    TensorBoard point shows it (a collective: the condition is the same everywhere), and every
    --tensorboard-log-interval iterations the step's scalars to TensorBoard (the logging rank's)."""
    lg, iteration = state.cfg.logging, state.iteration
    tb_due = lg.tensorboard_dir is not None and iteration % lg.tensorboard_log_interval == 0
    norm = None
    if lg.log_params_norm and (tb_due or iteration % lg.log_interval == 0):
        norm = params_norm(state.optimizer, state.ps)
    if tb_due and logger.writer is not None:
        memory = memory_scalars(state.ps.device) if lg.log_memory_to_tensorboard else None
        logger.scalars(step_scalars(out, lr, state.scaler.scale, norm, memory), iteration, state.consumed_samples)
    return norm
