"""One optimizer step: the schedule's forward and backward, the gradients' reduction, norm and
skip decision, clipping, the step of every placement, the LR schedule."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_p2r import reliability
from megatron_p2r.config import global_batch_size
from megatron_p2r.model import mtp
from megatron_p2r.moe import aux_loss
from megatron_p2r.moe.expert_bias import expert_bias_names, update_expert_biases
from megatron_p2r.parallel.grads import clip_coefficient, grad_norm_and_non_finite, unscale_and_clip
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.schedules import get_forward_backward_func
from megatron_p2r.training.diagnostics import num_zeros_in_grad
from megatron_p2r.training.state import TrainState


def reduce_loss(loss: Optional[torch.Tensor], ps: ParallelState) -> float:
    """The global batch's token-mean loss on every rank: the schedules return each DP rank's
    share of it on the last stage (None elsewhere), so it is their sum over PP and DP."""
    value = loss.detach().clone().float().reshape(1) if ps.is_last_stage else torch.zeros(1, device=ps.device)
    if ps.group("pp") is not None:
        dist.all_reduce(value, group=ps.group("pp"))
    if ps.group("dp") is not None:
        dist.all_reduce(value, group=ps.group("dp"))
    return value.item()


def train_step(state: TrainState, microbatches: List[dict]) -> dict:
    """One optimizer step over ``microbatches``; skips the update, and the LR schedule's advance, when a
    gradient is non-finite.

    The model computes in its weights' dtype; gradients accumulate in fp32 ``main_grad``
    buffers and are reduced by the DDP (in backward with --overlap-grad-reduce); norm, clipping
    and AdamW act on the fp32 main parameters (this rank's shards with the distributed optimizer).
    """
    cfg, ps, optimizer = state.cfg, state.ps, state.optimizer
    samples = global_batch_size(cfg, ps.layout.world_size, state.consumed_samples)
    optimizer.zero_grad()
    state.ddp.zero_grad_buffer(len(microbatches), keep=optimizer.grads_zeroed_by_host_step())
    forward_backward = get_forward_backward_func(state.plan.schedule)
    scale, timers, m = state.scaler.scale, state.timers, cfg.model
    with timers("forward-backward"):
        loss = forward_backward(
            state.model, microbatches, ps, loss_scale=scale, on_backward_scale=aux_loss.set_backward_scale
        )
        with timers("all-grads-sync"):
            state.ddp.finish_grad_sync()
    names = expert_bias_names(m, state.plan.layer_keys)  # none without MoE layers, whatever the flag says
    if names:  # after every step's backward, skipped or not (Megatron-LM's place)
        update_expert_biases(state.model, names, m.num_experts, m.moe_router_bias_update_rate, ps.device)
    with timers("optimizer"):
        optimizer.prepare_grads()
        reliability.on_gradients(state.iteration + 1, ps.rank, [ms.main for ms in optimizer.shards])
        with timers("optimizer-clip-main-grad"):
            scaled_norm, found_inf = grad_norm_and_non_finite(optimizer.main_grads, optimizer.norm_mask, ps)
        state.scaler.update(found_inf)
        optimizer.check_finite(found_inf)
        grad_norm, zeros = float("nan"), None
        if not found_inf:
            grad_norm = scaled_norm / scale
            if cfg.logging.log_num_zeros_in_grad:  # before the host step may zero its layers' gradients
                with timers("optimizer-count-zeros"):
                    zeros = num_zeros_in_grad(optimizer, ps)
            with timers("optimizer-clip-main-grad"):
                unscale_and_clip(optimizer.grads_to_unscale, scaled_norm, scale, cfg.train.clip_grad)
            with timers("optimizer-inner-step"):
                optimizer.step(clip_coefficient(scaled_norm, scale, cfg.train.clip_grad))
            state.scheduler.step(samples)
            state.skipped_in_a_row = 0
        else:
            state.skipped_in_a_row += 1
    state.iteration += 1
    state.consumed_samples += samples
    aux = aux_loss.pop_recorded()
    return {
        "lm_loss": reduce_loss(loss, ps),
        "grad_norm": grad_norm,
        "skipped": bool(found_inf),
        "global_batch_size": samples,
        "moe_aux_loss": float(torch.stack(aux).sum()) if aux else None,
        "num_zeros_in_grad": zeros,  # with --log-num-zeros-in-grad, None on a skipped step as in Megatron-LM
        "mtp_losses": mtp.pop_losses(cfg.model.mtp_num_layers, ps.device, (ps.group("pp"), ps.group("dp"))),
    }
