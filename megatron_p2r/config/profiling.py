"""The profiling section: Megatron-LM's profiler flags, with its defaults (docs/profiling.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_p2r.config.fields import ConfigError, opt
from megatron_p2r.config.ranges import at_least

# Where --use-pytorch-profiler writes its trace when there is no --tensorboard-dir (Megatron-LM
# hands torch.profiler None there and fails when the trace is written).
DEFAULT_TRACE_DIR = "torch_profile"


@dataclass(frozen=True)
class ProfilingConfig:
    profile: bool = opt(
        False,
        "Profile the steps --profile-step-start to --profile-step-end on --profile-ranks: a "
        "torch.profiler trace with --use-pytorch-profiler, otherwise (CUDA) a cudaProfilerStart/Stop "
        "range for nsys --capture-range=cudaProfilerApi.",
    )
    profile_step_start: int = opt(10, "Global step to start profiling.")
    profile_step_end: int = opt(12, "Global step to stop profiling.")
    use_pytorch_profiler: bool = opt(
        False,
        f"Trace with torch.profiler into --tensorboard-dir (else ./{DEFAULT_TRACE_DIR}), for "
        "TensorBoard or ui.perfetto.dev.",
    )
    profile_ranks: List[int] = opt([0], "Global ranks to profile.", nargs="+")
    record_memory_history: bool = opt(
        False,
        "CUDA: record the allocator's history on the last rank and dump a snapshot every "
        "--log-interval steps (pytorch.org/memory_viz reads it).",
    )
    memory_snapshot_path: str = opt("snapshot.pickle", "Where the last rank dumps the memory snapshot.")

    def check(self, world_size: int) -> None:
        """A window of at least one step, on ranks the run has (Megatron-LM's torch.profiler
        schedule fails on an empty window only when the profiler starts)."""
        if not self.profile:
            return
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end ({self.profile_step_end}) must be greater than --profile-step-start "
                f"({self.profile_step_start}): the window holds end - start steps"
            )
        missing = [rank for rank in self.profile_ranks if rank >= world_size]
        if missing:
            raise ConfigError(
                f"--profile-ranks {' '.join(map(str, missing))}: this run has ranks 0 to {world_size - 1}"
            )


# Type and range of every numeric field (config/ranges.py).
RANGES = {"profile_step_start": at_least(0), "profile_step_end": at_least(0), "profile_ranks": at_least(0)}
