"""RNG streams that keep dropout consistent across tensor-parallel ranks.

Two streams, as in Megatron:
- the default generator, seeded identically on every TP rank of a stage, drives dropout on
  *replicated* activations (residual branches), so TP peers drop the same elements;
- the ``model-parallel`` stream, seeded with ``seed + 2718 + tp_rank``, drives dropout on
  *split* activations (attention probabilities of this rank's heads), so peers differ.

Under sequence parallelism the "replicated" regions hold a different sequence shard on each
TP rank, so their dropout (embedding, residual branches) draws from the model-parallel stream
too, as in Megatron-LM: ``dropout_rng(device, sequence_parallel)`` picks the stream.

Activation recomputation must replay the same masks: ``checkpoint`` records both streams at
forward time and restores them during recomputation.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.utils.checkpoint

_MODEL_PARALLEL_OFFSET = 2718
_PIPELINE_OFFSET = 100
_CONTEXT_PARALLEL_OFFSET = 7919  # beyond 100 x PP and 2718 + TP of practical layouts: CP ranks' seeds stay apart


class RNGStatesTracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.state = None

    def _get(self):
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state):
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def seed(self, seed: int) -> None:
        saved = self._get()
        gen_seed(self.device, seed)
        self.state = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the model-parallel stream, then return to the default stream."""
        if self.state is None:
            raise RuntimeError("model-parallel RNG not seeded; call seed_everything() first")
        saved = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(saved)


def dropout_rng(device: torch.device, sequence_parallel: bool):
    """The RNG context of dropout outside the TP matmuls: the default stream (the same masks
    on every TP rank of a replicated activation), or the model-parallel stream when the
    activation is a sequence shard."""
    return get_rng_tracker(device).fork() if sequence_parallel else contextlib.nullcontext()


def gen_seed(device: torch.device, seed: int) -> None:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


_TRACKERS: dict = {}


def get_rng_tracker(device: torch.device) -> RNGStatesTracker:
    key = str(device)
    if key not in _TRACKERS:
        _TRACKERS[key] = RNGStatesTracker(device)
        _TRACKERS[key].seed(_MODEL_PARALLEL_OFFSET)
    return _TRACKERS[key]


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device: torch.device, cp_rank: int = 0) -> None:
    """Default stream: seed + 100*pp_rank, the same on the CP ranks of a sequence (they draw the
    whole sequence's residual dropout mask and keep their chunks: ``context.dropout``);
    model-parallel stream: seed + 2718 + tp_rank + 7919*cp_rank, so the CP ranks, which hold
    different tokens, draw their own attention-dropout and sequence-parallel masks. CP rank 0's
    streams are the one-process run's."""
    gen_seed(device, seed + _PIPELINE_OFFSET * pp_rank)
    get_rng_tracker(device).seed(seed + _MODEL_PARALLEL_OFFSET + tp_rank + _CONTEXT_PARALLEL_OFFSET * cp_rank)


def checkpoint(fn: Callable, *args, device: torch.device, draws: bool = True):
    """Activation checkpointing that replays both RNG streams during recomputation.

    Traced by ``torch.compile`` (``--compile``): a region that ``draws`` no random numbers is
    torch's checkpoint region inside the graph (dynamo takes no ``context_fn``, and there is
    nothing to replay); one that draws runs eagerly between graphs, replaying the streams as
    here (dynamo cannot fork the model-parallel stream: ``get_rng_state`` breaks the graph)."""
    if torch.compiler.is_compiling():
        if not draws:
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return _replaying_checkpoint_between_graphs(fn, *args, device=device)
    return _replaying_checkpoint(fn, *args, device=device)


def _replaying_checkpoint(fn: Callable, *args, device: torch.device):
    tracker = get_rng_tracker(device)
    recorded = tracker.state

    @contextlib.contextmanager
    def replay():
        current = tracker.state
        tracker.state = recorded
        try:
            yield
        finally:
            tracker.state = current

    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), replay())
    )


# torch.compiler.disable imports torch._dynamo (seconds) when applied; this form, when first called
_replaying_checkpoint_between_graphs = torch._disable_dynamo(_replaying_checkpoint)
