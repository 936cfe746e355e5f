"""The validation loss, on a fixed set, and its log record."""

from __future__ import annotations

import torch

from megatron_p2r.config import num_microbatches
from megatron_p2r.metrics import TrainingLogger
from megatron_p2r.pipeline.schedules import get_forward_backward_func
from megatron_p2r.training.diagnostics import validation_ppl
from megatron_p2r.training.data import microbatch_iterator, take
from megatron_p2r.training.state import TrainState
from megatron_p2r.training.step import reduce_loss


@torch.no_grad()
def evaluate(state: TrainState, valid_dataset) -> float:
    """Validation loss on a fixed, deterministic set: the first eval-iters global batches,
    averaged over their valid tokens as the training loss is."""
    cfg, ps = state.cfg, state.ps
    state.model.eval()
    n = num_microbatches(cfg, ps.layout.world_size) * cfg.logging.eval_iters
    batches = take(microbatch_iterator(valid_dataset, 0, cfg, ps), n, "validation")
    forward_backward = get_forward_backward_func(state.plan.schedule.serial)
    loss = forward_backward(state.model, batches, ps, forward_only=True)
    state.model.train()
    return reduce_loss(loss, ps)


def evaluate_and_log(state: TrainState, valid_ds, logger: TrainingLogger) -> float:
    """Evaluate and log the validation loss (a record of the loop's log)."""
    cfg = state.cfg
    loss = evaluate(state, valid_ds)
    record = {
        "iteration": state.iteration,
        "eval_loss": loss,
        "phase": cfg.p2r.p2r_phase,
        "tokens": state.consumed_samples * cfg.model.seq_length,
    }
    points = {"lm loss validation": loss}  # Megatron-LM's TensorBoard tags
    if cfg.logging.log_validation_ppl_to_tensorboard:
        record["eval_ppl"] = points["lm loss validation ppl"] = validation_ppl(loss)
    logger.log(record, f"validation loss at iteration {state.iteration}: {loss:.6f}")
    logger.scalars(points, state.iteration, state.consumed_samples)
    return loss
