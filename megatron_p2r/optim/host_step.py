"""The host optimizer step of offloaded layers, overlapped with what follows it
(``--overlap-cpu-optimizer-d2h-h2d``), on one worker thread: layers are stepped one after
another, each by the host kernels on the rank's ``--host-optimizer-threads`` threads
(``optim/host_kernels.py``; all-fp32 AdamW too, bitwise torch's fused kernel), so the cores are
used without oversubscribing them, whatever OMP_NUM_THREADS says.

**When a layer's step starts.** With gradient clipping (``--clip-grad`` > 0) or fp16 loss
scaling, not before the global gradient norm is known: the clipping coefficient and the skip
decision on a non-finite gradient depend on every gradient of the step, and the optimizers are
not linear in their gradient, so no part of an update can be computed earlier and corrected
later. ZeRO-Offload faces the same constraint; its one-step delayed parameter update, which changes
training, is ``optim/delayed_update.py`` (``--cpu-offload-delayed-param-update``). Without either
(``--clip-grad 0`` with bf16 or fp32: ``early``, the step plan's ``StepPlan.host_step``)
nothing global gates the update, so a layer's step starts as soon as its gradients are final in
the last micro-batch's backward: the DDP reports each bucket whose reduction has started
(``reduction_started``) and the worker finishes that reduction (waits, divides by the DP size)
before stepping; the gradients are zeroed only once the norm has read them (``_zero_after``). A non-finite gradient, which
would skip the serial step, is then an error (``check_finite``): some layers are already
updated.

**What it overlaps.** The rest of backward (``early``), the resident step and the next
iteration's forward up to each offloaded layer: the fetch of a layer's weights waits for that
layer's step only (``wait(key)``). Every tensor a step reads or writes belongs to that layer and
nothing else touches it before the fetch, so the weights are bitwise those of the serial step.
Each layer is stepped by its own optimizer over the shared state (``layer_optimizers``); torch's
kernels and the host kernels release the GIL, so the worker computes while Python runs the model.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch

from megatron_p2r.optim.optimizer import WrappedOptimizer

Build = Callable[[List[dict]], torch.optim.Optimizer]  # groups -> an optimizer of the run's kind


class HostStepper(Protocol):
    """The host placement's step, whichever way the step plan runs it (config/step_plan.py):
    ``SerialHostStep``, ``HostStep`` (overlapped or early), ``DelayedHostStep``. ``defers``: the
    weights whose gradients it clips, steps and zeroes itself (none for the serial step, whose
    gradients the caller unscales and clips)."""

    param_groups: list
    defers: frozenset
    inner: torch.optim.Optimizer  # over all the host mains: their state, state dicts
    by_layer: Dict[int, torch.optim.Optimizer]  # one per layer (``layer_optimizers``), when it steps by layer

    def submit(self, coeff: float) -> None: ...
    def wait(self, key=None) -> None: ...
    def backward_done(self) -> None: ...
    def flush(self) -> None: ...
    def check_finite(self, found_inf: bool) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...


class HostStepLink:
    """The host step as the DDP and the offload manager call it. Both are built before the
    optimizer (its mains are the DDP's buffers), so each is handed this link, made from the step
    plan before all three; the optimizer connects it once to the stepper it builds. The DDP
    reports buckets to ``reduction_started`` when ``starts_in_backward`` (the plan's ``early``);
    a layer's fetch waits on ``wait``. ``make_nvme``: (stepper, key -> its host ``MainShard``s)
    -> the state's NVMe file (``offload/nvme.py``), made on connecting; None: state in RAM."""

    def __init__(
        self,
        starts_in_backward: bool = False,
        make_nvme: Optional[Callable[[HostStepper, Dict[int, list]], object]] = None,
    ):
        self.starts_in_backward, self._make_nvme = starts_in_backward, make_nvme
        self.stepper: Optional[HostStepper] = None
        self.nvme = None

    def connect(self, stepper: HostStepper, layers: Dict[int, list]) -> None:
        if self.stepper is not None:
            raise RuntimeError("a host step link is connected to one host step")
        self.stepper = stepper
        if self._make_nvme is not None:
            self.nvme = self._make_nvme(stepper, layers)

    def reduction_started(self, bucket) -> None:
        self.stepper.reduction_started(bucket)

    def wait(self, key) -> None:
        """Until layer ``key``'s step is done (nothing to wait for before one is connected)."""
        if self.stepper is not None:
            self.stepper.wait(key)


def hyperparameters(groups: list) -> List[dict]:
    """Each group's settings but its parameters (what the LR scheduler writes)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def set_hyperparameters(optimizer: torch.optim.Optimizer, hyper: List[dict]) -> None:
    for group, values in zip(optimizer.param_groups, hyper, strict=True):
        group.update(values)


def layer_optimizers(
    build: Build, inner: torch.optim.Optimizer, layers: Dict[int, list]
) -> Dict[int, torch.optim.Optimizer]:
    """One optimizer of ``inner``'s kind per layer (``layers``: key -> its ``MainShard``s), over
    that layer's mains in ``inner``'s groups, keeping its state in ``inner``'s state dict (the
    one that checkpoints read and load): each steps one layer, so layers may step on several
    threads at once. ``relink`` after ``inner`` loads a state dict (torch replaces the dict)."""
    out = {}
    for key, shards in layers.items():
        mains = {id(ms.main) for ms in shards}
        out[key] = build(
            [
                {**values, "params": [p for p in g["params"] if id(p) in mains]}
                for g, values in zip(inner.param_groups, hyperparameters(inner.param_groups), strict=True)
            ]
        )
    relink(inner, out)
    return out


def relink(inner: torch.optim.Optimizer, by_layer: Dict[int, torch.optim.Optimizer]) -> None:
    for optimizer in by_layer.values():
        optimizer.state = inner.state


class SerialHostStep(WrappedOptimizer):
    """The serial host step: ``inner`` stepped after the norm on the calling thread; with
    ``by_layer`` (``layer_optimizers``; state on NVMe, offload/nvme.py) one layer at a time in
    forward order, so each layer's state is read while the next one's is prefetched."""

    defers = frozenset()

    def __init__(self, inner: torch.optim.Optimizer, by_layer: Optional[Dict[int, torch.optim.Optimizer]] = None):
        super().__init__(inner)
        self.by_layer = by_layer or {}

    def submit(self, coeff: float) -> None:
        """Step (the caller multiplied these gradients by ``coeff`` already)."""
        if not self.by_layer:
            self.inner.step()
            return
        hyper = hyperparameters(self.inner.param_groups)  # the groups' current rates
        for optimizer in self.by_layer.values():
            set_hyperparameters(optimizer, hyper)
            optimizer.step()

    def wait(self, key=None) -> None:
        """Nothing runs after ``submit`` returns."""

    def backward_done(self) -> None:
        """Nothing waits for backward."""

    def flush(self) -> None:
        """Every update is in the weights once ``submit`` returns."""

    def check_finite(self, found_inf: bool) -> None:
        """A non-finite step is skipped before it starts."""

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)
        relink(self.inner, self.by_layer)


class HostStep:
    """Steps ``inner`` (a torch optimizer over the host mains of ``layers``: forward-ordered
    lists of ``MainShard``) one layer at a time on one worker thread, each layer with its optimizer
    of ``by_layer`` (``layer_optimizers``); the host kernels use the rank's threads
    (``host_kernels.set_threads``, from the step plan).

    ``param_groups`` are the groups the LR scheduler writes; the workers read private copies,
    refreshed when a step's first layer is submitted, so the next iteration's learning rate never
    reaches a step still running. ``buckets``: layer key -> the DDP buckets holding its gradients
    (needed when ``early``)."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        by_layer: Dict[int, torch.optim.Optimizer],
        layers: Dict[int, list],
        early: bool = False,
        buckets: Optional[Dict[int, list]] = None,
    ):
        self.inner, self.by_layer, self.layers, self.early = inner, by_layer, layers, early
        self.param_groups = [{k: v for k, v in g.items()} for g in inner.param_groups]
        self.buckets = buckets or {}
        self._layers_of_bucket: Dict[int, List[int]] = {}
        for key, held in self.buckets.items():
            for bucket in held:
                self._layers_of_bucket.setdefault(id(bucket), []).append(key)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optimizer")
        self._running: Dict[int, Future] = {}
        # while a step's layers are queued in backward: layer -> its buckets not reported yet
        self._waiting: Optional[Dict[int, int]] = None

    @property
    def state(self):
        return self.inner.state

    @property
    def defers(self) -> frozenset:
        """The weights whose gradients this step reads and zeroes itself."""
        return frozenset(id(ms.param) for shards in self.layers.values() for ms in shards)

    def _hyperparameters_to_worker(self) -> None:
        """The scheduler's rates to every layer's optimizer (none may be stepping)."""
        hyper = hyperparameters(self.param_groups)
        for optimizer in (self.inner, *self.by_layer.values()):
            set_hyperparameters(optimizer, hyper)

    def _begin(self) -> None:
        """The first layer of a step: the last step is done, the workers take this step's rates."""
        self.wait()
        self._hyperparameters_to_worker()

    def reduction_started(self, bucket) -> None:
        """The DDP started ``bucket``'s reduction (``early``): step each layer whose buckets all have."""
        if self._waiting is None:
            self._begin()
            self._waiting = {key: len(self.buckets.get(key, ())) for key in self.layers}
        for key in self._layers_of_bucket.get(id(bucket), ()):
            self._waiting[key] -= 1
            if self._waiting[key] == 0:
                self._running[key] = self._pool.submit(self._early_step, key)

    def _early_step(self, key: int) -> None:
        for bucket in self.buckets[key]:
            bucket.buffer.finish_grad_reduce(bucket)
        self._step_layer(key, 1.0, zero=False)

    def submit(self, coeff: float) -> None:
        """After the norm: start every layer's step not started in backward, gradients multiplied
        by ``coeff`` (unscale and clip) first; zero the gradients of those that were, once their
        steps end (the norm has read them by now)."""
        if self.early and coeff != 1.0:
            raise RuntimeError(f"a host step started in backward cannot be unscaled or clipped (coefficient {coeff})")
        if self._waiting is None:
            self._begin()
        started, self._waiting = dict(self._running), None
        for key in self.layers:
            before = started.get(key)
            self._running[key] = (
                self._pool.submit(self._zero_after, before, key)
                if before is not None
                else self._pool.submit(self._step_layer, key, coeff)
            )

    def _zero_after(self, step: Future, key: int) -> None:
        """Every step task was queued before any of these, so the one awaited is running or done."""
        step.result()
        for ms in self.layers[key]:
            ms.grad.zero_()

    def _step_layer(
        self,
        key: int,
        coeff: float,
        zero: bool = True,
        apply: bool = True,
        grads: Optional[List[torch.Tensor]] = None,
        hyper: Optional[List[dict]] = None,
    ) -> None:
        """Step layer ``key`` on ``grads`` (default: its shards' gradients), with the rates
        ``hyper`` (default: those its optimizer holds); ``apply``: round the updated mains into the
        weights."""
        shards: Sequence = self.layers[key]
        grads = [ms.grad for ms in shards] if grads is None else grads
        with torch.no_grad():
            if coeff != 1.0:
                torch._foreach_mul_(grads, coeff)
            for ms, grad in zip(shards, grads, strict=True):
                ms.main.grad = grad
            if hyper is not None:
                set_hyperparameters(self.by_layer[key], hyper)
            self.by_layer[key].step()
            for ms, grad in zip(shards, grads, strict=True):
                ms.main.grad = None
                if zero:
                    grad.zero_()
            if apply:
                self._apply_layer(key)

    def _apply_layer(self, key: int) -> None:
        """The layer's weights become its mains (rounded to the weights' dtype)."""
        with torch.no_grad():
            for ms in self.layers[key]:
                if not ms.aliases_param:
                    ms.param.data.view(-1)[ms.start : ms.end].copy_(ms.main.reshape(-1))

    def backward_done(self) -> None:
        """The iteration no longer reads the weights (its backward is over); nothing to do here."""

    def flush(self) -> None:
        """Every update taken so far in the weights and the state (before a save, a load, the end)."""
        self.wait()

    def check_finite(self, found_inf: bool) -> None:
        """A step whose gradients are not all finite would be skipped; one whose offloaded layers
        started stepping during backward cannot be."""
        if found_inf and self.early:
            self.wait()
            raise RuntimeError(
                "a non-finite gradient in a step whose offloaded layers were already updated during "
                "backward (--overlap-cpu-optimizer-d2h-h2d with --clip-grad 0 and no fp16 loss "
                "scaling): resume from the last checkpoint, with --clip-grad > 0 to skip such steps"
            )

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
        relink(self.inner, self.by_layer)
