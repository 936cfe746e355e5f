"""The training loop: ``pretrain`` (what ``pretrain_m6.py`` runs under torchrun) sets up, resumes,
trains and evaluates; ``train`` steps until the end, logging, evaluating, saving and exiting on
their intervals."""

from __future__ import annotations

import time
from typing import List, Optional

from megatron_p2r import reliability
from megatron_p2r.config import Config, ConfigError, check_values, num_microbatches, train_iters
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.lifecycle import lock_save_dir, release_groups, resume_checkpoint
from megatron_p2r.metrics import TrainingLogger, format_line, model_flops_per_token, peak_memory_bytes
from megatron_p2r.moe import aux_loss
from megatron_p2r.offload.runtime import format_report
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.memory import stage_state_bytes
from megatron_p2r.training.data import build_datasets, microbatch_iterator, take
from megatron_p2r.training.evaluation import evaluate, evaluate_and_log
from megatron_p2r.training.launch import init_distributed, resolve_device, resolve_vocab, setup_parallel
from megatron_p2r.training.profiling import StepProfiler, start_memory_history
from megatron_p2r.training.saving import ExitSignal, save, save_and_check_exit, save_at_end
from megatron_p2r.training.state import TrainingStopped, TrainState, build_train_state, describe_memory
from megatron_p2r.training import diagnostics
from megatron_p2r.training.step import train_step
from megatron_p2r.training.timers import format_timers, timer_scalars
from megatron_p2r.wandb_writer import WandbWriter


def log_rank(ps: ParallelState) -> int:
    """The rank that logs: last stage, tp 0, dp 0 (it holds the loss)."""
    return ps.layout.rank(0, 0, ps.pp_size - 1)


def pretrain(cfg: Config) -> dict:
    """Train (or with --eval-only, evaluate) and return the final figures of this rank."""
    started = time.monotonic()  # --exit-duration-in-mins counts from here, as Megatron-LM's from its start
    check_values(cfg)
    if not cfg.logging.eval_only and cfg.train.train_iters is None and cfg.train.train_samples is None:
        raise ConfigError("either --train-iters or --train-samples is needed (or --eval-only)")
    device = resolve_device(cfg)
    init_distributed(cfg, device)
    cfg = resolve_vocab(cfg)
    ps, plan = setup_parallel(cfg, device)
    completed = False
    try:
        lock = lock_save_dir(cfg, ps)
        try:
            result = _run(cfg, ps, plan, started)
            completed = True
            return result
        finally:
            if lock is not None:
                lock.release()
    finally:
        release_groups(ps, completed)


def _run(cfg: Config, ps: ParallelState, plan: ParallelPlan, started: float) -> dict:
    start_memory_history(cfg, ps)  # before the model is built: its allocations are history too
    state = build_train_state(cfg, ps, plan)
    logs = ps.rank == log_rank(ps)
    logger = TrainingLogger(
        cfg.logging.log_file,
        cfg.logging.tensorboard_dir,
        enabled=logs,
        wandb=WandbWriter.open(cfg, plan, ps.device.type) if logs else None,
    )
    mem = describe_memory(state)
    optimizer_bytes = stage_state_bytes(plan, ps.pp_rank, ps.coords)["optimizer"]  # the optimizer allocates at step 1
    print(
        f"[rank {ps.rank}] stage {ps.pp_rank} tp {ps.tp_rank} cp {ps.cp_rank} dp {ps.dp_rank} ep {ps.ep_rank}: "
        f"{mem['parameters']:,} parameters, {mem['param_bytes'] / 2**20:.1f} MiB params, "
        f"{mem['grad_bytes'] / 2**20:.1f} MiB grads, {optimizer_bytes / 2**20:.1f} MiB optimizer",
        flush=True,
    )
    if state.offload is not None:
        print(format_report(ps.rank, state.offload.describe()), flush=True)
    resume_checkpoint(state)
    train_ds, valid_ds = build_datasets(cfg, ps, state.iteration, state.consumed_samples)
    result = {"rank": ps.rank, "losses": [], "memory": mem}
    if cfg.logging.eval_only:
        result["eval_loss"] = evaluate(state, valid_ds)
        logger.log(
            {"iteration": state.iteration, "eval_loss": result["eval_loss"]},
            f"validation loss at iteration {state.iteration}: {result['eval_loss']:.6f}",
        )
        logger.close()
        return result
    result.update(train(state, train_ds, valid_ds, logger, started))
    from megatron_p2r.checkpoint.async_save import finish_pending

    finish_pending(ps)  # the last asynchronous save is written and published before exit
    state.optimizer.finish_host_step()
    state.ddp.finish_param_sync()  # the last step's overlapped all-gather is not left pending at shutdown
    logger.close()
    return result


class _LogWindow:
    """The steps since the last training log line: a record averages its interval."""

    def __init__(self, consumed_samples: int):
        self.reset(consumed_samples)

    def reset(self, consumed_samples: int) -> None:
        self.start, self.steps, self.consumed_samples = time.perf_counter(), 0, consumed_samples


def train(state: TrainState, train_ds, valid_ds, logger: TrainingLogger, started: Optional[float] = None) -> dict:
    """Step until --train-iters (or the steps of --train-samples); after each step, on their
    intervals: a log record, an evaluation, a checkpoint, an exit. The number of micro-batches
    follows the batch-size schedule of the consumed samples."""
    cfg, ps, t = state.cfg, state.ps, state.cfg.train
    world = ps.layout.world_size
    data = microbatch_iterator(train_ds, state.consumed_samples, cfg, ps)
    exit_signal = ExitSignal(t.exit_signal_handler, t.exit_duration_in_mins, started, t.exit_signal)
    losses, eval_losses = [], []
    window = _LogWindow(state.consumed_samples)
    first_iteration, last_iteration = state.iteration, train_iters(cfg, world)
    state.model.train()
    profiler = StepProfiler(cfg, ps, first_iteration)
    try:
        while state.iteration < last_iteration:
            profiler.before_step(state.iteration)
            lr = state.scheduler.lr
            reliability.before_step(state.iteration + 1, ps.rank)
            n_mb = num_microbatches(cfg, world, state.consumed_samples)
            with state.timers("batch-generator"):
                microbatches = take(data, n_mb, "training")
            out = train_step(state, microbatches)
            reliability.after_step(state.iteration, ps.rank)
            profiler.after_step(state.iteration)
            losses.append(out["lm_loss"])
            window.steps += 1
            _stop_after_skipped_steps(state, out, logger)
            out["params_norm"] = diagnostics.after_step(state, out, lr, logger)
            if state.iteration % cfg.logging.log_interval == 0:
                record = _training_record(state, out, lr, losses[-window.steps :], window)
                timed = state.timers.report(window.steps)  # a collective of every rank, as the MoE figures
                if cfg.logging.log_timers_to_tensorboard:
                    record.update(timer_scalars(timed, record["ms_per_iter"] / 1000))
                logger.log(record, "\n".join([format_line(record), *([format_timers(timed)] if timed else [])]))
                window.reset(state.consumed_samples)
            if cfg.logging.evaluates and state.iteration % cfg.logging.eval_interval == 0:
                eval_losses.append(evaluate_and_log(state, valid_ds, logger))
            if save_and_check_exit(state, logger, exit_signal):
                return {"losses": losses, "eval_losses": eval_losses, "exited_early": True}
    finally:
        profiler.close()  # a window the run did not finish is written with the steps it has
    save_at_end(state, logger, first_iteration)
    return {"losses": losses, "eval_losses": eval_losses}


def _stop_after_skipped_steps(state: TrainState, out: dict, logger: TrainingLogger) -> None:
    """Warn about a skipped step; save and raise TrainingStopped after --max-skipped-steps in a row."""
    t, ck = state.cfg.train, state.cfg.checkpoint
    # fp16 skips are routine while the scale adapts; they count once it is at its floor.
    counted = not t.fp16 or state.scaler.scale <= state.scaler.min_scale
    if not (out["skipped"] and counted):
        return
    logger.info(
        f"warning: iteration {state.iteration} skipped: non-finite loss or gradients on at least one "
        f"rank ({state.skipped_in_a_row} in a row; --max-skipped-steps {t.max_skipped_steps})"
    )
    if state.skipped_in_a_row >= t.max_skipped_steps:
        save(state, logger, reason="stopping on non-finite values")
        saved = f"the last good state is saved in {ck.save}" if ck.save else "nothing was saved (no --save)"
        raise TrainingStopped(
            f"{state.skipped_in_a_row} consecutive steps had non-finite loss or gradients "
            f"(--max-skipped-steps {t.max_skipped_steps}); {saved}"
        )


def _training_record(state: TrainState, out: dict, lr: float, window_losses: List[float], window: _LogWindow) -> dict:
    """The log record of an interval (Megatron's log line): mean loss, throughput, memory.
    With MoE this is a collective (the interval's dropped fraction and min/max expert load)."""
    cfg, ps = state.cfg, state.ps
    seq, world = cfg.model.seq_length, ps.layout.world_size
    flops_per_token = model_flops_per_token(cfg.model, cfg.train.recompute == "full")
    elapsed = time.perf_counter() - window.start
    tokens_per_s = (state.consumed_samples - window.consumed_samples) * seq / elapsed
    record = {
        "iteration": state.iteration,
        "train_iters": train_iters(cfg, world),
        "consumed_samples": state.consumed_samples,
        "global_batch_size": out["global_batch_size"],
        "phase": cfg.p2r.p2r_phase,
        "tokens": state.consumed_samples * seq,
        "flops": state.consumed_samples * seq * flops_per_token,
        "lm_loss": sum(window_losses) / len(window_losses),
        "lr": lr,
        "grad_norm": out["grad_norm"],
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * flops_per_token / world / 1e12,
        "ms_per_iter": 1000 * elapsed / window.steps,
        "peak_memory_gib": peak_memory_bytes(ps.device) / 2**30,
        "loss_scale": state.scaler.scale,
        "skipped": int(out["skipped"]),
    }
    if out["moe_aux_loss"] is not None:
        record["moe_aux_loss"] = out["moe_aux_loss"]
    for key in ("num_zeros_in_grad", "params_norm"):  # this step's, as Megatron-LM logs them
        if out.get(key) is not None:
            record[key] = out[key]
    for depth, value in enumerate(out.get("mtp_losses") or [], start=1):
        record[f"mtp_{depth} loss"] = value  # Megatron-LM's names (the last step's, as moe_aux_loss)
    if cfg.model.num_experts:
        record.update(aux_loss.pop_routing_stats(ps.device) or {})
    return record
