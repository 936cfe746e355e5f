"""ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021, §5 "DPU") for the
host-offloaded layers: ``--cpu-offload-delayed-param-update``.

With clipping or fp16 loss scaling an offloaded layer's host step cannot start before the global
norm, and the next forward needs layer 0's step first, so most of the host step is exposed
(``optim/host_step.py``). Here the host step of iteration t (its gradients, clipping coefficient,
skip decision and learning rate, all iteration t's) runs on the workers during iteration t+1,
which still runs on the weights it started with; the new weights are used from iteration t+2.
The resident layers step as usual.

- **Gradients.** Each bucket of the offloaded layers has a second gradient tensor
  (``BucketState.swap_grads``): when iteration t's step is submitted its step reads the tensor
  iteration t accumulated into, and iteration t+1 accumulates into the other; the step zeroes
  what it read when done.
- **Weights.** The step updates the mains and the state only (the mains are copies of the 16-bit
  weights, which iteration t+1 does not read). The weights are written once iteration t+1 no
  longer needs them: when its backward is over (``backward_done``, before its norm), layer by
  layer on the workers, each after that layer's step; the next forward's fetch of a layer waits
  for that layer's write only. A skipped iteration (non-finite gradients) submits no step, so
  the write that follows it applies nothing new.
- **Order.** A layer's tasks run in the order they were queued (step t, write t, step t+1, ...):
  each task first waits for the layer's previous one, which was queued earlier, so with several
  threads it is running or done. A step takes a private copy of the hyperparameters (the
  learning rate the scheduler set for its iteration) when submitted.
- **Warm-up.** The first ``warmup_steps`` optimizer steps are not delayed (ZeRO-Offload turns DPU
  on after its first iterations, when the weights change fastest).
- ``flush`` (a save, a load, the end of training) writes the pending update into the weights:
  a checkpoint holds a consistent state, and a run that saves continues as the resumed one does.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Dict, List, Optional

import torch

from megatron_p2r.optim.host_step import HostStep, hyperparameters, set_hyperparameters
from megatron_p2r.parallel.grad_buffer import grad_range


class DelayedHostStep(HostStep):
    """``HostStep`` whose updates are written into the weights one iteration late. ``buckets``:
    layer key -> its gradient buckets (each given a second gradient tensor); ``steps_taken``: the
    optimizer's steps so far (skipped ones not counted); ``before_write``: waits for the fetches in
    flight (``OffloadManager.synchronize``)."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        by_layer: Dict[int, torch.optim.Optimizer],
        layers: Dict[int, list],
        buckets: Dict[int, list],
        warmup_steps: int,
        steps_taken: Callable[[], int],
        before_write: Optional[Callable[[], None]] = None,
    ):
        super().__init__(inner, by_layer, layers, early=False, buckets=buckets)
        self.warmup_steps, self.steps_taken, self.before_write = warmup_steps, steps_taken, before_write
        self._swapped = list({id(b): b for held in buckets.values() for b in held}.values())
        for bucket in self._swapped:
            bucket.add_second_grad()
        self._computing: Dict[int, Future] = {}  # delayed steps, not yet written into the weights
        self._unwritten = False  # a delayed step was submitted since the last write

    def submit(self, coeff: float) -> None:
        """Start iteration t's step of every offloaded layer on the gradients accumulated so far,
        then move the accumulation to the other gradient tensors."""
        if self.steps_taken() < self.warmup_steps:
            super().submit(coeff)
            return
        hyper = hyperparameters(self.param_groups)  # this step's rates, applied by its tasks (a layer's
        set_hyperparameters(self.inner, hyper)  # last step may still be running)
        for key, shards in self.layers.items():
            grads = [ms.grad for ms in shards]
            self._computing[key] = self._pool.submit(
                self._delayed_step, self._running.get(key), key, coeff, grads, hyper
            )
        for bucket in self._swapped:
            bucket.swap_grads()
        for shards in self.layers.values():
            for ms in shards:
                ms.grad = grad_range(ms.param, ms.start, ms.end)
        self._unwritten = True

    def _delayed_step(
        self, before: Optional[Future], key: int, coeff: float, grads: List[torch.Tensor], hyper: List[dict]
    ) -> None:
        if before is not None:
            before.result()
        self._step_layer(key, coeff, apply=False, grads=grads, hyper=hyper)

    def backward_done(self) -> None:
        """The iteration's backward is over: write the last delayed update into the weights, each
        layer once its step ends (the next fetch of that layer waits for this write)."""
        if not self._unwritten:
            return
        if self.before_write is not None:  # no fetch still reads the weights (CUDA: the copy stream)
            self.before_write()
        for key in self.layers:
            self._running[key] = self._pool.submit(self._write, self._computing.pop(key), key)
        self._unwritten = False

    def _write(self, step: Future, key: int) -> None:
        step.result()
        self._apply_layer(key)

    def wait(self, key=None) -> None:
        super().wait(key)
        if key is None:  # the steps end; their writes stay pending (``flush`` writes them)
            for step in self._computing.values():
                step.result()

    def flush(self) -> None:
        self.backward_done()
        self.wait()
