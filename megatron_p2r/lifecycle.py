"""What a run takes at its start and gives back at its end: the memory it needs, the lock on
``--save`` and the process groups.

``check_run_fits``: the planner's memory estimate against this host (``planning/preflight.py``)
before a model is built; every rank learns whether any rank failed, so none is left waiting in
a collective for a rank that stopped.

``lock_save_dir``: rank 0 locks ``--save`` (``checkpoint/lock.py``) before anything reads or
repairs it, and every rank learns the outcome, so a second run on the same directory stops at
once on every rank (rank 0 says who holds it) instead of two runs overwriting each other's
iterations; then ``resume_checkpoint`` repairs --save and loads --load.

``release_groups`` ends a run cleanly: after a completed run (whose last overlapped all-gather
of the distributed optimizer the loop has waited for) every rank waits for the others (no rank
tears down its connections while a peer still sends to it), then the groups the run created are
shut down and dropped here, while the interpreter is fully alive. A process group still
referenced when the interpreter exits is destroyed during finalization, where gloo's threads
abort the process (``terminate called without an active exception``, SIGABRT after the last
iteration): the model keeps the ParallelState, and with offload the model and its offload
manager reference each other, so without this the groups lived until then (docs/reliability.md).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_p2r import reliability
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.lock import DirectoryLock
from megatron_p2r.checkpoint.recovery import recover_save_dir
from megatron_p2r.config import Config, ConfigError, global_batch_size
from megatron_p2r.config.batch import scheduled_samples
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.preflight import check_memory


def _stop_together(failure: Optional[Exception], device: torch.device, others: Exception) -> None:
    """Raise ``failure`` on the rank that has one and ``others`` on every other rank, when any rank
    failed (a collective over the world: every rank calls it)."""
    flag = torch.tensor([1.0 if failure else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if flag.item():
        raise others


def check_run_fits(cfg: Config, plan: ParallelPlan, device: torch.device) -> None:
    """The planner's memory estimate of this host's ranks against its memory, on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    failure = None
    try:
        check_memory(cfg, plan, rank, device.type, device_free=free)
    except ConfigError as exc:
        failure = exc
    _stop_together(
        failure,
        device,
        ConfigError("this run does not fit in memory on another rank's host (that rank says how much it needs)"),
    )


def lock_save_dir(cfg: Config, ps: ParallelState) -> Optional[DirectoryLock]:
    """Rank 0's lock on --save (None elsewhere, and without --save); an error on every rank when
    another run holds it."""
    save = cfg.checkpoint.save
    if not save:
        return None
    lock, failure = None, None
    if ps.rank == 0:
        lock = DirectoryLock(save, "training run")
        try:
            os.makedirs(save, exist_ok=True)
            lock.acquire()
        except OSError as exc:
            failure = CheckpointError(f"--save {save}: cannot create or lock it ({exc.strerror})")
        except CheckpointError as exc:
            failure = exc
        for note in lock.notes:
            print(f"--save {save}: {note}", flush=True)
    _stop_together(failure, ps.device, CheckpointError(f"--save {save} is in use by another run (rank 0 says which)"))
    return lock


def release_groups(ps: ParallelState, completed: bool) -> None:
    """Shut down and forget the groups of ``ps`` (the world group is its creator's to destroy);
    after a completed run, first a barrier so every rank has finished its last transfer."""
    if completed and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    for group in ps.drop_groups():
        if dist.is_initialized() and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def resume_checkpoint(state) -> None:
    """Repair --save after a crash (rank 0, logged), then load --load (``--save D --load D`` on an
    empty D starts from scratch: see ``load_checkpoint``)."""
    ck, ps = state.cfg.checkpoint, state.ps
    if ck.save and ps.rank == 0:
        for line in recover_save_dir(ck.save):
            print(f"checkpoint recovery: {line}", flush=True)
    if ps.layout.world_size > 1:
        dist.barrier()
    if not ck.load:
        return
    from megatron_p2r.checkpoint.io import load_checkpoint

    if load_checkpoint(ck.load, state, finetune=ck.finetune) is None:
        if ck.exit_on_missing_checkpoint:  # Megatron-LM's sys.exit(): status 0, nothing trained
            if ps.rank == 0:
                print(f"--exit-on-missing-checkpoint: no checkpoint in {ck.load}; exiting", flush=True)
            raise SystemExit(0)
    else:
        reliability.record("resumed", ps.rank, state.iteration)
        world = ps.layout.world_size
        if ps.rank == 0 and state.consumed_samples != scheduled_samples(state.cfg, world, state.iteration):
            print(
                f"resuming at iteration {state.iteration} with --global-batch-size "
                f"{global_batch_size(state.cfg, world, state.consumed_samples)}: the {state.consumed_samples} "
                "consumed samples carry over (as in Megatron-LM), and so does the learning-rate schedule's "
                "position (samples of the applied updates)",
                flush=True,
            )
