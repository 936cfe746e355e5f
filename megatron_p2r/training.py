"""The training loop: set up, step, log, evaluate, save, resume.

``pretrain(cfg)`` is what ``pretrain_m6.py`` runs under torchrun. Its parts are separate
functions (``setup``, ``train_step``, ``evaluate``) so tests can drive them in-process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import socket
import time
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_p2r import offload, reliability
from megatron_p2r.config import (Config, ConfigError, build_step_plan, check_values, global_batch_size,
                                  num_microbatches, train_iters, train_samples, validate)
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.lifecycle import check_run_fits, lock_save_dir, release_groups, resume_checkpoint
from megatron_p2r.metrics import TrainingLogger, format_line, model_flops_per_token, peak_memory_bytes
from megatron_p2r.wandb_writer import WandbWriter
from megatron_p2r.model.m6 import M6Model, build_model
from megatron_p2r.offload.optimizer import finish_host_optimizer, host_step_settings, optimizer_placement
from megatron_p2r.offload.runtime import format_report
from megatron_p2r.moe import aux_loss
from megatron_p2r.optim import host_kernels
from megatron_p2r.optim.grad_scaler import LossScaler
from megatron_p2r.optim.mixed_precision import MixedPrecisionOptimizer, build_mixed_precision_optimizer
from megatron_p2r.optim.scheduler import LRScheduler
from megatron_p2r.parallel.ddp import DistributedDataParallel
from megatron_p2r.parallel.grads import clip_coefficient, grad_norm_and_non_finite, unscale_and_clip
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState, initialize_plan
from megatron_p2r.planning.memory import stage_state_bytes
from megatron_p2r.pipeline.schedules import get_forward_backward_func


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps); a checkpoint was saved."""


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint saves and a resume restores."""

    cfg: Config
    ps: ParallelState
    plan: ParallelPlan
    model: M6Model
    ddp: DistributedDataParallel        # gradient buffers and their reduction
    optimizer: MixedPrecisionOptimizer
    scheduler: LRScheduler
    scaler: LossScaler
    iteration: int = 0
    consumed_samples: int = 0
    skipped_in_a_row: int = 0
    offload: Optional[offload.OffloadManager] = None  # when --cpu-offload-layers is set

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return list(self.model.parameters())


# ----------------------------------------------------------------------------- set-up

def resolve_device(cfg: Config) -> torch.device:
    kind = cfg.parallel.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the job torchrun started (or a one-rank job when run directly)."""
    if dist.is_initialized():
        return
    backend = cfg.parallel.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--distributed-backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if "RANK" in os.environ:
        # Under torchrun --max-restarts the restarted workers share the launcher's store with the
        # dead ones, whose keys (gloo/NCCL peer addresses) are still in it: without a prefix per
        # attempt the new ranks connect to dead processes ("Connection refused" at init, torch 2.13).
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"p2r_attempt_{attempt}/", store), rank=rank,
                                world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)


def setup_parallel(cfg: Config, device: torch.device) -> Tuple[ParallelState, ParallelPlan]:
    world = dist.get_world_size()
    validate(cfg, world)
    plan = ParallelPlan.for_world(cfg, world)
    check_run_fits(cfg, plan, device)
    ps = initialize_plan(plan, device, timeout=datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, device)
    return ps, plan


def resolve_vocab(cfg: Config) -> Config:
    """The config with the tokenizer's vocabulary size, when one is configured: resolved before
    ``validate`` so the checked config is the one every module reads."""
    if cfg.data.tokenizer_type is None:
        return cfg
    from megatron_p2r.data.tokenizers import build_tokenizer
    tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)  # NullTokenizer's size
    return cfg.replace(vocab_size=tokenizer.vocab_size)


def build_train_state(cfg: Config, ps: ParallelState, plan: Optional[ParallelPlan] = None) -> TrainState:
    """The model (16-bit weights with --bf16/--fp16), its offload, gradient buffers and optimizer."""
    plan = plan or ParallelPlan.build(cfg, ps.layout)
    model = build_model(cfg, ps, plan, device=offload.build_device(cfg.offload, ps))
    if cfg.train.compile:
        from megatron_p2r.model.compiled import compile_layers   # imports torch._dynamo: seconds, only when asked
        compile_layers(model.layers)
    manager, steps = None, build_step_plan(cfg)   # steps: how each placement's optimizer steps
    if cfg.offload.cpu_offload_layers is not None:  # chosen layers' weights, grads and optimizer state on host
        manager = offload.apply_offload(model, plan.stage(ps.pp_rank).offloaded, cfg.offload, ps,
                                        plan.module_state_bytes(ps.pp_rank, ps.coords), delayed_update=steps.delayed)
    p = cfg.parallel
    ddp = DistributedDataParallel(model, plan, ps, overlap_grad_reduce=p.overlap_grad_reduce,
                                  overlap_param_gather=p.overlap_param_gather,
                                  fetched=manager.fetched_param_ids if manager else (),
                                  waits_whole=model.layers.values() if cfg.train.compile else ())
    host_step = host_step_settings(manager, steps) if manager else None
    host_kernels.set_threads(steps.threads)
    optimizer = build_mixed_precision_optimizer(ddp, plan, ps, cfg.train,
                                                optimizer_placement(manager) if manager else None,
                                                manager.synchronize if manager else None, host_step)
    if manager is not None:  # fetches wait for the overlapped host step; its state on NVMe if asked
        finish_host_optimizer(optimizer, manager, steps, ps.rank)
    return TrainState(cfg=cfg, ps=ps, plan=plan, model=model, ddp=ddp, optimizer=optimizer,
                      scheduler=LRScheduler(optimizer, cfg, ps.layout.world_size),
                      scaler=LossScaler(cfg.train), offload=manager)


# ----------------------------------------------------------------------------- data

def build_datasets(cfg: Config, ps: ParallelState, iteration: int = 0, consumed_samples: int = 0):
    """(train, valid) datasets: every item is int64 tokens of length seq_length + 1; no training
    set for a run that trains nothing (--eval-only), no validation set with --eval-iters 0.

    A resumed run's training set holds the samples consumed so far plus those of its remaining
    iterations (``config.batch.train_samples``): the same size as before when the global batch
    size is unchanged, and enough when a resumed run changes it."""
    eval_samples = cfg.logging.eval_iters * global_batch_size(cfg, ps.layout.world_size)
    samples = 0 if cfg.logging.eval_only else train_samples(cfg, ps.layout.world_size, iteration, consumed_samples)
    if cfg.data.mock_data:
        from megatron_p2r.data.mock import MockGPTDataset
        m = cfg.model
        return (MockGPTDataset(samples, m.seq_length, m.vocab_size, cfg.train.seed) if samples else None,
                MockGPTDataset(eval_samples, m.seq_length, m.vocab_size, cfg.train.seed + 1) if eval_samples else None)
    from megatron_p2r.data.builder import build_train_valid_test_datasets
    train, valid, _ = build_train_valid_test_datasets(cfg.data, cfg.model.seq_length, cfg.train.seed,
                                                      (samples, eval_samples, 0), cfg.model.vocab_size)
    return train, valid


def microbatch_iterator(dataset, consumed_samples: int, cfg: Config, ps: ParallelState) -> Iterator[dict]:
    """This data-parallel rank's micro-batches, continuing after ``consumed_samples``."""
    from megatron_p2r.data.samplers import PretrainingSampler
    sampler = PretrainingSampler(len(dataset), consumed_samples, cfg.train.micro_batch_size,
                                 ps.dp_rank, ps.dp_size)
    for indices in sampler:
        sample = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices]))
        sample = sample.to(ps.device)
        yield {"tokens": sample[:, :-1], "labels": sample[:, 1:],
               "loss_mask": torch.ones_like(sample[:, 1:], dtype=torch.float32)}


def _take(iterator: Iterator[dict], n: int, what: str) -> List[dict]:
    batches = [b for _, b in zip(range(n), iterator, strict=False)]
    if len(batches) < n:
        raise RuntimeError(f"the {what} data ran out: needed {n} micro-batches, got {len(batches)}")
    return batches


# ----------------------------------------------------------------------------- steps

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
    scale = state.scaler.scale
    loss = forward_backward(state.model, microbatches, ps, loss_scale=scale,
                            on_backward_scale=aux_loss.set_backward_scale)
    state.ddp.finish_grad_sync()
    optimizer.prepare_grads()
    reliability.on_gradients(state.iteration + 1, ps.rank, [ms.main for ms in optimizer.shards])
    scaled_norm, found_inf = grad_norm_and_non_finite(optimizer.main_grads, optimizer.norm_mask, ps)
    state.scaler.update(found_inf)
    optimizer.check_finite(found_inf)
    grad_norm = float("nan")
    if not found_inf:
        grad_norm = scaled_norm / scale
        unscale_and_clip(optimizer.grads_to_unscale, scaled_norm, scale, cfg.train.clip_grad)
        optimizer.step(clip_coefficient(scaled_norm, scale, cfg.train.clip_grad))
        state.scheduler.step(samples)
        state.skipped_in_a_row = 0
    else:
        state.skipped_in_a_row += 1
    state.iteration += 1
    state.consumed_samples += samples
    aux = aux_loss.pop_recorded()
    return {"lm_loss": reduce_loss(loss, ps), "grad_norm": grad_norm, "skipped": bool(found_inf),
            "global_batch_size": samples, "moe_aux_loss": float(torch.stack(aux).sum()) if aux else None}


@torch.no_grad()
def evaluate(state: TrainState, valid_dataset) -> float:
    """Validation loss on a fixed, deterministic set: the first eval-iters global batches,
    averaged over their valid tokens as the training loss is."""
    cfg, ps = state.cfg, state.ps
    state.model.eval()
    n = num_microbatches(cfg, ps.layout.world_size) * cfg.logging.eval_iters
    batches = _take(microbatch_iterator(valid_dataset, 0, cfg, ps), n, "validation")
    forward_backward = get_forward_backward_func(state.plan.schedule.serial)
    loss = forward_backward(state.model, batches, ps, forward_only=True)
    state.model.train()
    return reduce_loss(loss, ps)


# ----------------------------------------------------------------------------- the loop

class ExitSignal:
    """Turns --exit-signal (SIGTERM; --exit-signal-handler) and the end of --exit-duration-in-mins,
    counted from ``started``, into a flag the loop checks after each step (then saves and exits)."""

    def __init__(self, enabled: bool, duration_mins: Optional[int] = None, started: Optional[float] = None,
                 signal_name: str = "SIGTERM"):
        self.enabled, self.received = enabled or duration_mins is not None, False
        started = time.monotonic() if started is None else started
        self.deadline = None if duration_mins is None else started + 60.0 * duration_mins
        if enabled:
            signal.signal(signal.Signals[signal_name], self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self, ps: ParallelState) -> bool:
        """Whether any rank received the signal or ran out of time: a collective over the world
        and a host sync, so only with one of the flags (every rank then calls it after every step)."""
        if not self.enabled:
            return False
        expired = self.deadline is not None and time.monotonic() >= self.deadline
        flag = torch.tensor([1.0 if self.received or expired else 0.0], device=ps.device)
        if ps.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def log_rank(ps: ParallelState) -> int:
    """The rank that logs: last stage, tp 0, dp 0 (it holds the loss)."""
    return ps.layout.rank(0, 0, ps.pp_size - 1)


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
    return {"rank": state.ps.rank, "parameters": sum(p.numel() for p in params),
            "param_bytes": _storage_bytes(params), "grad_bytes": _storage_bytes(state.ddp.buffer_tensors("grads")),
            "optimizer_bytes": _storage_bytes(mains) + _storage_bytes(moments)}


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
    state = build_train_state(cfg, ps, plan)
    logs = ps.rank == log_rank(ps)
    logger = TrainingLogger(cfg.logging.log_file, cfg.logging.tensorboard_dir, enabled=logs,
                            wandb=WandbWriter.open(cfg, plan, ps.device.type) if logs else None)
    mem = describe_memory(state)
    optimizer_bytes = stage_state_bytes(plan, ps.pp_rank, ps.coords)["optimizer"]   # the optimizer allocates at step 1
    print(f"[rank {ps.rank}] stage {ps.pp_rank} tp {ps.tp_rank} dp {ps.dp_rank} ep {ps.ep_rank}: "
          f"{mem['parameters']:,} parameters, {mem['param_bytes'] / 2**20:.1f} MiB params, "
          f"{mem['grad_bytes'] / 2**20:.1f} MiB grads, {optimizer_bytes / 2**20:.1f} MiB optimizer", flush=True)
    if state.offload is not None:
        print(format_report(ps.rank, state.offload.describe()), flush=True)
    resume_checkpoint(state)
    train_ds, valid_ds = build_datasets(cfg, ps, state.iteration, state.consumed_samples)
    result = {"rank": ps.rank, "losses": [], "memory": mem}
    if cfg.logging.eval_only:
        result["eval_loss"] = evaluate(state, valid_ds)
        logger.log({"iteration": state.iteration, "eval_loss": result["eval_loss"]},
                   f"validation loss at iteration {state.iteration}: {result['eval_loss']:.6f}")
        logger.close()
        return result
    result.update(train(state, train_ds, valid_ds, logger, started))
    from megatron_p2r.checkpoint.async_save import finish_pending
    finish_pending(ps)   # the last asynchronous save is written and published before exit
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
    while state.iteration < last_iteration:
        lr = state.scheduler.lr
        reliability.before_step(state.iteration + 1, ps.rank)
        n_mb = num_microbatches(cfg, world, state.consumed_samples)
        out = train_step(state, _take(data, n_mb, "training"))
        reliability.after_step(state.iteration, ps.rank)
        losses.append(out["lm_loss"])
        window.steps += 1
        _stop_after_skipped_steps(state, out, logger)
        if state.iteration % cfg.logging.log_interval == 0:
            record = _training_record(state, out, lr, losses[-window.steps:], window)
            logger.log(record, format_line(record))
            window.reset(state.consumed_samples)
        if cfg.logging.evaluates and state.iteration % cfg.logging.eval_interval == 0:
            eval_losses.append(_evaluate_and_log(state, valid_ds, logger))
        if _save_and_check_exit(state, logger, exit_signal):
            return {"losses": losses, "eval_losses": eval_losses, "exited_early": True}
    _save_at_end(state, logger, first_iteration)
    return {"losses": losses, "eval_losses": eval_losses}


def _stop_after_skipped_steps(state: TrainState, out: dict, logger: TrainingLogger) -> None:
    """Warn about a skipped step; save and raise TrainingStopped after --max-skipped-steps in a row."""
    t, ck = state.cfg.train, state.cfg.checkpoint
    # fp16 skips are routine while the scale adapts; they count once it is at its floor.
    counted = not t.fp16 or state.scaler.scale <= state.scaler.min_scale
    if not (out["skipped"] and counted):
        return
    logger.info(f"warning: iteration {state.iteration} skipped: non-finite loss or gradients on at least one "
                f"rank ({state.skipped_in_a_row} in a row; --max-skipped-steps {t.max_skipped_steps})")
    if state.skipped_in_a_row >= t.max_skipped_steps:
        _save(state, logger, reason="stopping on non-finite values")
        saved = f"the last good state is saved in {ck.save}" if ck.save else "nothing was saved (no --save)"
        raise TrainingStopped(f"{state.skipped_in_a_row} consecutive steps had non-finite loss or gradients "
                              f"(--max-skipped-steps {t.max_skipped_steps}); {saved}")


def _training_record(state: TrainState, out: dict, lr: float, window_losses: List[float],
                     window: _LogWindow) -> dict:
    """The log record of an interval (Megatron's log line): mean loss, throughput, memory.
    With MoE this is a collective (the interval's dropped fraction and min/max expert load)."""
    cfg, ps = state.cfg, state.ps
    seq, world = cfg.model.seq_length, ps.layout.world_size
    flops_per_token = model_flops_per_token(cfg.model, cfg.train.recompute == "full")
    elapsed = time.perf_counter() - window.start
    tokens_per_s = (state.consumed_samples - window.consumed_samples) * seq / elapsed
    record = {"iteration": state.iteration, "train_iters": train_iters(cfg, world),
              "consumed_samples": state.consumed_samples, "global_batch_size": out["global_batch_size"],
              "phase": cfg.p2r.p2r_phase,
              "tokens": state.consumed_samples * seq, "flops": state.consumed_samples * seq * flops_per_token,
              "lm_loss": sum(window_losses) / len(window_losses), "lr": lr,
              "grad_norm": out["grad_norm"], "tokens_per_s": tokens_per_s,
              "tflops": tokens_per_s * flops_per_token / world / 1e12,
              "ms_per_iter": 1000 * elapsed / window.steps,
              "peak_memory_gib": peak_memory_bytes(ps.device) / 2**30,
              "loss_scale": state.scaler.scale, "skipped": int(out["skipped"])}
    if out["moe_aux_loss"] is not None:
        record["moe_aux_loss"] = out["moe_aux_loss"]
    if cfg.model.num_experts:
        record.update(aux_loss.pop_routing_stats(ps.device) or {})
    return record


def _evaluate_and_log(state: TrainState, valid_ds, logger: TrainingLogger) -> float:
    cfg = state.cfg
    loss = evaluate(state, valid_ds)
    logger.log({"iteration": state.iteration, "eval_loss": loss, "phase": cfg.p2r.p2r_phase,
                "tokens": state.consumed_samples * cfg.model.seq_length},
               f"validation loss at iteration {state.iteration}: {loss:.6f}")
    return loss


def _save_and_check_exit(state: TrainState, logger: TrainingLogger, exit_signal: ExitSignal) -> bool:
    """Save on --save-interval; on --exit-interval or a signal, save (once) and return True."""
    t, ck = state.cfg.train, state.cfg.checkpoint
    saved = bool(ck.save and ck.save_interval and state.iteration % ck.save_interval == 0)
    if saved:
        _save(state, logger)
    if (t.exit_interval and state.iteration % t.exit_interval == 0) or exit_signal.any_rank(state.ps):
        if not saved:  # the interval save above is this iteration's checkpoint already
            _save(state, logger, reason="exit requested")
        return True
    return False


def _save_at_end(state: TrainState, logger: TrainingLogger, first_iteration: int) -> None:
    """Nothing new to save when the resumed checkpoint is already at --train-iters (a finished
    job relaunched): re-saving would replace that checkpoint with an identical one for nothing."""
    ck = state.cfg.checkpoint
    saved_now = ck.save_interval and state.iteration % ck.save_interval == 0
    if ck.save and state.iteration > first_iteration and not saved_now:
        _save(state, logger)


def _save(state: TrainState, logger: TrainingLogger, reason: str = "") -> None:
    if not state.cfg.checkpoint.save:
        return
    from megatron_p2r.checkpoint.async_save import save_checkpoint
    path = save_checkpoint(state.cfg.checkpoint.save, state, wait=bool(reason))   # an exit waits for it
    logger.info(f"saved checkpoint {path}" + (f" ({reason})" if reason else ""))


__all__ = ["pretrain", "train", "train_step", "evaluate", "TrainState", "ConfigError", "TrainingStopped"]
