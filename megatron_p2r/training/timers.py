"""Megatron-LM's step timers (--timing-log-level) and their report at each log interval.

Level 0 times nothing beyond the iteration (the log line's ms/iter); level 1 adds the phases a
step runs once (forward-backward, the gradient sync, the optimizer and its parts), level 2 adds
what runs once per micro-batch and is timed here: the batch generator. A timer above the chosen
level costs nothing; a timed one synchronises CUDA at its ends, as Megatron's does, so it can slow
the step it measures.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

# name -> level, in the order of Megatron-LM's report (training_log's timers_to_log).
TIMERS: Dict[str, int] = {
    "forward-backward": 1,
    "all-grads-sync": 1,
    "optimizer-clip-main-grad": 1,
    "optimizer-count-zeros": 1,
    "optimizer-inner-step": 1,
    "optimizer": 1,
    "batch-generator": 2,
}


class Timers:
    """Sums of seconds per timer since the last report; ``timers(name)`` times a block."""

    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        self.seconds: Dict[str, float] = defaultdict(float)

    def names(self) -> List[str]:
        """The timers this level records."""
        return [name for name, level in TIMERS.items() if level <= self.level]

    @contextmanager
    def __call__(self, name: str):
        if TIMERS[name] > self.level:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report(self, steps: int) -> Dict[str, Tuple[float, float]]:
        """{name: (min, max) over all ranks of its seconds per step} since the last report, then
        reset. A collective of every rank (one all-reduce)."""
        names = self.names()
        if not names:
            return {}
        own = torch.tensor([self.seconds.get(n, 0.0) / steps for n in names], dtype=torch.float64)
        both = torch.cat([own, -own]).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self.seconds.clear()
        values = both.cpu().tolist()
        return {n: (-values[len(names) + i], values[i]) for i, n in enumerate(names)}


def format_timers(report: Dict[str, Tuple[float, float]]) -> str:
    """Megatron-LM's stdout form: (min, max) milliseconds across ranks, per step."""
    rows = [
        f"    {name} {'.' * max(48 - len(name), 1)}: ({lo * 1e3:.2f}, {hi * 1e3:.2f})"
        for name, (lo, hi) in report.items()
    ]
    return "\n".join(["(min, max) time across ranks (ms):", *rows])


def timer_scalars(report: Dict[str, Tuple[float, float]], seconds_per_iteration: float) -> Dict[str, float]:
    """--log-timers-to-tensorboard's scalars, Megatron-LM's tags and units: the iteration time
    and each timer's maximum over ranks, seconds per step."""
    return {"iteration-time": seconds_per_iteration, **{f"{name}-time": hi for name, (_, hi) in report.items()}}
