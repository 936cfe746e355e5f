"""Fault injection for drills and tests, and clear messages for distributed failures (see
docs/reliability.md; the repair of a save directory after a crash is ``checkpoint/recovery.py``).

Faults are injected only when the environment asks for it, so a drill on a real cluster needs
no code change::

    P2R_FAULT="kill_after_iter:3@rank1"          SIGKILL global rank 1 right after iteration 3
    P2R_FAULT="nan_grad:3+@rank1"                NaN in rank 1's gradients from iteration 3 on
    P2R_FAULT="stall:2:30@rank1"                 rank 1 sleeps 30 s before iteration 2
    P2R_FAULT="kill_in_save:4:publish"           SIGKILL at point 'publish' of the save of iteration 4

Several faults are separated by ``;``. ``ITERS`` is ``K``, ``K-M`` or ``K+``; ``@rankR`` limits a
fault to global rank R (default: every rank). A fault fires only in the first attempt of a
torchrun job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted job runs clean, as
it would after a real crash. ``P2R_EVENT_LOG=FILE`` makes every rank append one JSON line per
completed iteration, resume and injected fault (with wall-clock times), which is how the cost
of a restart is measured.

The hooks are three calls in the training loop and one per save point in
``checkpoint/io.py``; with ``P2R_FAULT`` unset each is a dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import time
import traceback
from typing import Optional, Tuple

from megatron_p2r.config import ConfigError

FAULT_ENV = "P2R_FAULT"
EVENT_LOG_ENV = "P2R_EVENT_LOG"
KINDS = ("kill_after_iter", "nan_grad", "stall", "kill_in_save")
# The moments of ``checkpoint.io.save_checkpoint`` where ``kill_in_save`` can strike, in order.
SAVE_POINTS = (
    "shards",  # this rank's files are written, the others may not be: only iter_N.tmp exists
    #             (with --async-save: in the background writer, while training goes on)
    "metadata",  # every shard written, metadata.json not yet
    "publish",  # metadata.json written, iter_N.tmp not yet renamed to iter_N
    "latest",  # iter_N in place, latest_checkpointed_iteration.txt still names the previous one
    "prune",
)  # latest names N, older checkpoints (--keep-last) not yet removed


class FaultSpecError(ConfigError):
    """A malformed P2R_FAULT value."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: Optional[int]  # None: no upper bound ("K+")
    rank: Optional[int]  # None: every rank
    arg: Optional[str] = None  # stall: seconds; kill_in_save: the save point

    def covers(self, iteration: int, rank: int) -> bool:
        return (
            (self.rank is None or self.rank == rank)
            and self.first <= iteration
            and (self.last is None or iteration <= self.last)
        )


_FAULT = re.compile(r"^(?P<kind>\w+):(?P<iters>\d+(?:-\d+|\+)?)(?::(?P<arg>[\w.]+))?(?:@rank(?P<rank>\d+))?$")


@functools.lru_cache(maxsize=8)
def parse_faults(spec: str) -> Tuple[Fault, ...]:
    """``P2R_FAULT`` -> faults; a typo is an error, never a drill that silently does nothing."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        m = _FAULT.match(item)
        if not m or m["kind"] not in KINDS:
            raise FaultSpecError(
                f"{FAULT_ENV}: cannot parse {item!r}; expected KIND:ITERS[:ARG][@rankR] with KIND "
                f"one of {', '.join(KINDS)} and ITERS K, K-M or K+"
            )
        iters = m["iters"]
        if iters.endswith("+"):
            first, last = int(iters[:-1]), None
        elif "-" in iters:
            first, last = map(int, iters.split("-"))
        else:
            first = last = int(iters)
        arg = m["arg"]
        if m["kind"] == "stall" and (arg is None or not re.fullmatch(r"\d+(\.\d+)?", arg)):
            raise FaultSpecError(f"{FAULT_ENV}: {item!r}: stall needs the seconds to sleep, e.g. stall:2:30")
        if m["kind"] == "kill_in_save" and arg not in SAVE_POINTS:
            raise FaultSpecError(f"{FAULT_ENV}: {item!r}: kill_in_save needs a save point, one of {SAVE_POINTS}")
        faults.append(Fault(m["kind"], first, last, None if m["rank"] is None else int(m["rank"]), arg))
    return tuple(faults)


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _active(kind: str, iteration: int, rank: int) -> Optional[Fault]:
    spec = os.environ.get(FAULT_ENV)
    if not spec or _restart_count() > 0:
        return None
    for fault in parse_faults(spec):
        if fault.kind == kind and fault.covers(iteration, rank):
            return fault
    return None


def record(event: str, rank: int, iteration: int, **extra) -> None:
    """Append an event to ``P2R_EVENT_LOG`` (when set)."""
    path = os.environ.get(EVENT_LOG_ENV)
    if not path:
        return
    line = json.dumps(
        {
            "event": event,
            "rank": rank,
            "iteration": iteration,
            "restart": _restart_count(),
            "time": time.time(),
            **extra,
        }
    )
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _kill(what: str, rank: int, iteration: int) -> None:
    print(f"[{FAULT_ENV}] rank {rank}: SIGKILL {what}", flush=True)
    record("fault", rank, iteration, fault=what)
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- hooks


def before_step(iteration: int, rank: int) -> None:
    """Training loop, before the step that produces ``iteration``: ``stall``."""
    fault = _active("stall", iteration, rank)
    if fault is not None:
        print(f"[{FAULT_ENV}] rank {rank}: stalling {fault.arg} s before iteration {iteration}", flush=True)
        record("fault", rank, iteration, fault="stall")
        time.sleep(float(fault.arg))


def on_gradients(iteration: int, rank: int, params) -> None:
    """``train_step`` after the gradients are final (reduced), before the non-finite check: ``nan_grad``.
    Only this rank's copy is poisoned, like a fault in one device's memory."""
    if _active("nan_grad", iteration, rank) is None:
        return
    for p in params:
        if p.grad is not None:
            p.grad.view(-1)[0] = float("nan")
            record("fault", rank, iteration, fault="nan_grad")
            return


def after_step(iteration: int, rank: int) -> None:
    """Training loop, after ``iteration`` completed: event log, ``kill_after_iter``."""
    record("iteration", rank, iteration)
    if _active("kill_after_iter", iteration, rank) is not None:
        _kill(f"after iteration {iteration}", rank, iteration)


def save_point(point: str, iteration: int, rank: int) -> None:
    """``checkpoint.io.save_checkpoint`` at ``point`` (one of SAVE_POINTS): ``kill_in_save``."""
    fault = _active("kill_in_save", iteration, rank)
    if fault is not None and fault.arg == point:
        _kill(f"while saving iteration {iteration} (point '{point}')", rank, iteration)


# ----------------------------------------------------------------------------- distributed failures

_DIST_PATTERNS = (
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "NCCL",
    "Watchdog",
)


def describe_distributed_failure(exc: BaseException, timeout_minutes: Optional[float] = None) -> Optional[str]:
    """A one-paragraph explanation when ``exc`` is a failed or timed-out collective, else None.

    gloo's own message ("Timed out waiting 2000ms for recv operation") names neither the
    collective nor the caller; both are read off the traceback.
    """
    import torch.distributed as dist

    text = f"{type(exc).__name__}: {exc}"
    backend_error = getattr(dist, "DistBackendError", None)
    if not (backend_error and isinstance(exc, backend_error)) and not any(p in text for p in _DIST_PATTERNS):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    op = next(
        (
            f.name
            for f in reversed(frames)
            if f"distributed{os.sep}" in f.filename and not f.name.startswith("_") and f.name != "wrapper"
        ),
        None,
    )
    ours = next((f for f in reversed(frames) if f"megatron_p2r{os.sep}" in f.filename), None)
    where = f" called from {os.path.relpath(ours.filename)}:{ours.lineno} ({ours.name})" if ours else ""
    timed_out = "imed out" in text
    what = f"collective {op or 'operation'}{where}"
    if timed_out:
        limit = f" after {timeout_minutes:g} min (--distributed-timeout-minutes)" if timeout_minutes else ""
        cause = f"timed out{limit}: another rank stalled, died or is not in the same collective"
    else:
        cause = "failed: a peer rank died or closed its connection (see that rank's log)"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{what} {cause}. Backend said: {first_line}"


__all__ = [
    "FAULT_ENV",
    "EVENT_LOG_ENV",
    "SAVE_POINTS",
    "Fault",
    "FaultSpecError",
    "parse_faults",
    "record",
    "before_step",
    "on_gradients",
    "after_step",
    "save_point",
    "describe_distributed_failure",
]
