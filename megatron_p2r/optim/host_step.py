"""The host optimizer step of offloaded layers, overlapped with what follows it
(``--overlap-cpu-optimizer-d2h-h2d``).

The step of a host-resident layer cannot start before the global gradient norm is known: the
clipping coefficient and the skip decision on a non-finite gradient (fp16 loss scaling) depend
on every gradient of the step, and AdamW is not linear in its gradient, so no part of the update
can be computed earlier and corrected later. ZeRO-Offload faces the same constraint: it copies
gradients out and computes their norms during backward, then steps on the CPU after backward (its
"delayed parameter update", which hides the step under the next iteration, steps with stale
gradients and so changes training; it is not what this does).

What is hidden instead is the wait *after* the step: each offloaded layer's step (unscale and
clip of its gradients, AdamW, rounding of its fp32 mains into 16-bit weights, zeroing its
gradients for the next step) runs on a worker thread, layer after layer in forward order, while
the main thread steps the resident layers and runs the next iteration's forward up to that layer:
the fetch of an offloaded layer's weights waits for that layer's step only. Every tensor the
step reads or writes belongs to that layer and nothing else touches it before the fetch, so the
weights are bitwise those of the serial step. torch kernels release the GIL, so one thread keeps
the host busy while Python runs the forward.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Sequence

import torch


class HostStep:
    """Steps ``inner`` (a torch optimizer over the host mains of ``layers``: forward-ordered
    lists of ``MainShard``) one layer at a time on a worker thread.

    ``param_groups`` are the groups the LR scheduler writes; the worker reads private copies,
    refreshed when a step is submitted, so the next iteration's learning rate never reaches a step
    still running."""

    def __init__(self, inner: torch.optim.Optimizer, layers: Dict[int, list]):
        self.inner, self.layers = inner, layers
        self.param_groups = [{k: v for k, v in g.items()} for g in inner.param_groups]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optimizer")
        self._running: Dict[int, Future] = {}

    @property
    def state(self):
        return self.inner.state

    @property
    def param_ids(self) -> set:
        """The weights whose gradients this step reads and zeroes itself."""
        return {id(ms.param) for shards in self.layers.values() for ms in shards}

    def _hyperparameters_to_worker(self) -> None:
        for private, public in zip(self.inner.param_groups, self.param_groups, strict=True):
            private.update({k: v for k, v in public.items() if k != "params"})

    def submit(self, coeff: float) -> None:
        """Start every layer's step, gradients multiplied by ``coeff`` (unscale and clip) first."""
        self.wait()
        self._hyperparameters_to_worker()
        for key, shards in self.layers.items():
            self._running[key] = self._pool.submit(self._step_layer, shards, coeff)

    def _step_layer(self, shards: Sequence, coeff: float) -> None:
        with torch.no_grad():
            grads = [ms.grad for ms in shards]
            if coeff != 1.0:
                torch._foreach_mul_(grads, coeff)
            for ms in shards:
                ms.main.grad = ms.grad
            self.inner.step()        # steps exactly the mains that have a .grad: this layer's
            for ms in shards:
                ms.main.grad = None
                if not ms.aliases_param:
                    ms.param.data.view(-1)[ms.start:ms.end].copy_(ms.main.reshape(-1))
                ms.grad.zero_()

    def wait(self, key=None) -> None:
        """Until layer ``key``'s step (every layer's when None) is done; re-raises its error."""
        keys: List[int] = list(self._running) if key is None else [key] if key in self._running else []
        for k in keys:
            self._running.pop(k).result()

    def state_dict(self) -> dict:
        self.wait()
        self._hyperparameters_to_worker()
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.wait()
        self.inner.load_state_dict(sd)
        self.param_groups = [{k: v for k, v in g.items()} for g in self.inner.param_groups]
