"""The loop's checkpoint hooks: a save on --save-interval, a save and an exit on --exit-interval,
--exit-duration-in-mins or a signal (``ExitSignal``), and a save at the end."""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_p2r.metrics import TrainingLogger
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training.state import TrainState


class ExitSignal:
    """Turns --exit-signal (SIGTERM; --exit-signal-handler) and the end of --exit-duration-in-mins,
    counted from ``started``, into a flag the loop checks after each step (then saves and exits)."""

    def __init__(
        self,
        enabled: bool,
        duration_mins: Optional[int] = None,
        started: Optional[float] = None,
        signal_name: str = "SIGTERM",
    ):
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


def save_and_check_exit(state: TrainState, logger: TrainingLogger, exit_signal: ExitSignal) -> bool:
    """Save on --save-interval; on --exit-interval or a signal, save (once) and return True."""
    t, ck = state.cfg.train, state.cfg.checkpoint
    saved = bool(ck.save and ck.save_interval and state.iteration % ck.save_interval == 0)
    if saved:
        save(state, logger)
    if (t.exit_interval and state.iteration % t.exit_interval == 0) or exit_signal.any_rank(state.ps):
        if not saved:  # the interval save above is this iteration's checkpoint already
            save(state, logger, reason="exit requested")
        return True
    return False


def save_at_end(state: TrainState, logger: TrainingLogger, first_iteration: int) -> None:
    """Nothing new to save when the resumed checkpoint is already at --train-iters (a finished
    job relaunched): re-saving would replace that checkpoint with an identical one for nothing."""
    ck = state.cfg.checkpoint
    saved_now = ck.save_interval and state.iteration % ck.save_interval == 0
    if ck.save and state.iteration > first_iteration and not saved_now:
        save(state, logger)


def save(state: TrainState, logger: TrainingLogger, reason: str = "") -> None:
    if not state.cfg.checkpoint.save:
        return
    from megatron_p2r.checkpoint.async_save import save_checkpoint

    path = save_checkpoint(state.cfg.checkpoint.save, state, wait=bool(reason))  # an exit waits for it
    logger.info(f"saved checkpoint {path}" + (f" ({reason})" if reason else ""))
