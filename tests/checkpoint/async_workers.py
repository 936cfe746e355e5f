"""What each spawned rank runs for the asynchronous save tests (no pytest import: ranks start
faster). DP2 with the distributed optimizer and dropout on."""

from __future__ import annotations

import os
import threading

import torch

from megatron_p2r.checkpoint import async_save
from megatron_p2r.checkpoint.io import save_checkpoint as save_now
from megatron_p2r.training import setup_parallel
from tests.checkpoint.common import cfg_of
from tests.helpers import run_steps

FLAGS = dict(global_batch_size=8, use_distributed_optimizer=True)


def slow_writer(started: threading.Event, release: threading.Event, delay: float = 1.0):
    """A ``write_parts`` that writes only once ``release`` is set, and ``delay`` s after that:
    the training thread steps on meanwhile, and a publish that does not wait for the writer
    finds the files missing."""
    write = async_save.write_parts

    def slow(tmp, fragments):
        started.set()
        release.wait()
        threading.Event().wait(delay)
        write(tmp, fragments)

    return slow


def async_save_and_resume(rank: int, world: int, root: str) -> dict:
    """4 steps with an asynchronous save after step 2 (its writer held back until step 4 is done,
    so training has updated every tensor in place meanwhile) and a synchronous one beside it;
    the async one is published after step 4. Then resume from each, 2 steps."""
    c = cfg_of(async_save=True, **FLAGS)
    ps, _ = setup_parallel(c, torch.device("cpu"))
    started, release = threading.Event(), threading.Event()
    async_save.write_parts = slow_writer(started, release)
    out: dict = {}
    copy = async_save.host_copy

    def counted_copy(fragments):
        host = copy(fragments)
        out["host_copy_bytes"] = sum(t.numel() * t.element_size() for _, _, t in host)
        return host

    async_save.host_copy = counted_copy

    def save_after_2(state) -> None:
        if state.iteration == 2:
            save_now(os.path.join(root, "sync"), state)
            async_save.save_checkpoint(os.path.join(root, "async"), state)
            out["latest_while_writing"] = os.path.exists(
                os.path.join(root, "async", "latest_checkpointed_iteration.txt")
            )
        if state.iteration == 4:
            release.set()
            async_save.finish_pending(state.ps)

    out["straight"], _ = run_steps(c, ps, 4, after_step=save_after_2)
    out["writer_started"] = started.is_set()
    out["resumed"], _ = run_steps(c, ps, 2, load=os.path.join(root, "async"))
    out["from_sync"], _ = run_steps(c, ps, 2, load=os.path.join(root, "sync"))
    return out
