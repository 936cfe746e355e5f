"""Whether the GPU lane's tests can run here, decided before anything heavy is imported.

Every module of ``tests/cuda`` calls ``skip_without_cuda()`` first thing, so that on a machine
without a CUDA device collecting the lane costs a stat call, not a torch import (and each
module is reported as skipped with the reason).

``P2R_CUDA_DRY_RUN=1`` runs the lane on CPU instead (gloo instead of NCCL, tiny shapes): the
parts that need CUDA (allocator statistics, the profiler's streams, the NCCL path) skip one by
one, everything else runs — how the lane itself is checked on a machine without a GPU.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest

DRY_RUN_ENV = "P2R_CUDA_DRY_RUN"


def dry_run() -> bool:
    return os.environ.get(DRY_RUN_ENV) == "1"


def no_cuda_reason() -> str | None:
    """Why the lane cannot run on CUDA here, or None when it can."""
    if "torch" not in sys.modules and not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
        return "no CUDA device (no /dev/nvidia*)"
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__}"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL"
    return None


def skip_without_cuda() -> None:
    """Skip the calling test module unless a CUDA device with NCCL is here (or in a dry run)."""
    if dry_run():
        return
    reason = no_cuda_reason()
    if reason:
        pytest.skip(
            f"{reason}; the GPU lane needs one CUDA GPU with NCCL ({DRY_RUN_ENV}=1 runs it on CPU)",
            allow_module_level=True,
        )
