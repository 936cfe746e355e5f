"""The optimizer over main parameters — megatron-core's FP32Optimizer,
Float16OptimizerWithFloat16Params and DistributedOptimizer semantics in one class.

- fp32 weights are their own main parameters (the optimizer steps the model's tensors);
- 16-bit weights (``--bf16``/``--fp16``) get main copies held here, fp32 or with
  ``--main-params-dtype fp16`` fp16 (Transformer Engine's ``master_weight_dtype``); after each
  step the updated mains are rounded into the weights, so the forward never casts a weight.
  fp16 weights with fp16 mains are their own mains: no copy is made;
- under ``--use-distributed-optimizer`` a rank's mains are its shards of the gradient buffers'
  buckets (contiguous ranges: a parameter may be split between ranks, ``layout/buckets.py``),
  stepped on the reduce-scattered gradient shards; the updated weights are then all-gathered
  (``DistributedDataParallel.start_param_sync``).

Every main parameter's gradient is a view into ``main_grad``: nothing is copied. Granular
offload places each shard: "device"; "host" (weights on host: mains, optimizer state and step
there); "staged" (weights on the device, optimizer state on host: ``StagedOptimizer``). The
optimizer is ``--optimizer``'s (``optim/optimizer.py``); Adafactor's statistics of a matrix cut
between ranks are summed over them (``shared_pieces``). Checkpoints see global tensors only
(``optim/state_io.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from megatron_p2r.config import OPTIMIZERS, TrainConfig
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.optim.adafactor import Piece, SharedPieces
from megatron_p2r.optim.delayed_update import DelayedHostStep
from megatron_p2r.optim.host_step import HostStep, HostStepLink, HostStepper, SerialHostStep, layer_optimizers
from megatron_p2r.optim.optimizer import StagedOptimizer, make_optimizer, param_groups
from megatron_p2r.parallel.ddp import DistributedDataParallel
from megatron_p2r.parallel.grad_buffer import DTYPES, grad_range
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import ParallelState

PLACEMENTS = ("device", "staged", "host")  # the order of their steps: the host step waits for fetches


@dataclass(frozen=True)
class HostStepSettings:
    """How the host placement steps (the step plan's ``host_step``, config/step_plan.py):
    ``how``: serial | overlapped | early | delayed; ``layers``: layer key -> its parameters' ids,
    in forward order; ``by_layer``: a serial step goes one layer at a time (state on NVMe);
    ``delay_after``: the delayed step's warm-up steps; ``link``: what the DDP and the offload
    manager call, connected to the stepper once it is built."""

    how: str
    layers: Dict[int, set]
    by_layer: bool = False
    delay_after: int = 0
    link: HostStepLink = field(default_factory=HostStepLink)


@dataclass
class MainShard:
    """The flat range [start, end) of ``param`` that this rank's optimizer steps (the whole
    parameter without the distributed optimizer)."""

    param: nn.Parameter
    name: str
    start: int
    end: int
    main: torch.Tensor  # the parameter itself, a view of it, or a copy in --main-params-dtype
    grad: torch.Tensor  # its range of ``param.main_grad``
    placement: str
    in_norm: bool  # counts in the global gradient norm (each logical element once)
    buffer: int  # the DDP buffer, bucket and position (in the buffer) of ``start``
    bucket: int
    position: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.param.numel()

    @property
    def aliases_param(self) -> bool:
        """The main parameter is (a view of) the weight itself: weights in the mains' dtype."""
        return self.param.dtype == self.main.dtype


def _main_of(p: nn.Parameter, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """The main parameter of ``p``'s flat range [start, end) in ``dtype``: the weight itself when
    it has that dtype, else a copy."""
    whole = start == 0 and end == p.numel()
    if p.dtype == dtype:
        return p if whole else p.data.view(-1)[start:end]
    return (p.detach() if whole else p.detach().view(-1)[start:end]).to(dtype)


def _takes_grad(main: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``main``, made to accept ``grad`` as its ``.grad`` (bf16 main gradients of fp32 or fp16
    mains): torch checks a gradient's dtype against the tensor's ``grad_dtype``, which None lifts
    (autograd still hands a weight a gradient of its own dtype). Megatron-LM passes such
    gradients to Transformer Engine's FusedAdam as ``decoupled_grad`` instead."""
    if grad.dtype != main.dtype:
        if not hasattr(main, "grad_dtype"):
            raise RuntimeError(
                f"--main-grads-dtype bf16 needs a torch whose tensors have grad_dtype (this is "
                f"{torch.__version__}): its main parameters are {main.dtype}"
            )
        main.grad_dtype = None
    return main


class ParamStates:
    """``optimizer.state[param]``: the optimizer's state of a parameter it steps whole."""

    def __init__(self, optimizer: "MixedPrecisionOptimizer"):
        self.optimizer = optimizer

    def _inner_state(self, p):
        shard = self.optimizer.whole_shards.get(id(p))
        if shard is None:
            raise KeyError("this rank steps no whole copy of that parameter (distributed optimizer shard?)")
        return self.optimizer.inner[shard.placement].state, shard.main

    def __getitem__(self, p) -> dict:
        state, main = self._inner_state(p)
        return state[main]

    def get(self, p, default=None):
        try:
            state, main = self._inner_state(p)
        except KeyError:
            return default
        return state.get(main, default)

    def __contains__(self, p) -> bool:
        return self.get(p) is not None

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizer.inner.values())


class MixedPrecisionOptimizer:
    """``--optimizer`` over ``shards``: ``zero_grad`` before a step's backward, ``prepare_grads``
    then ``step``. Each shard joins the group (``optim.optimizer.param_groups``: weight decay or
    not) of its weight, in the optimizer of its placement. ``shared``: placement -> Adafactor's
    shared pieces there (``shared_pieces``). ``host_step``: how the host placement steps
    (``HostStepSettings``; serial without). Each placement's optimizer is a typed field:
    ``device``, ``staged`` (``StagedOptimizer``) and ``host`` (a ``HostStepper``)."""

    def __init__(
        self,
        shards: List[MainShard],
        t: TrainConfig,
        ddp: DistributedDataParallel,
        before_host_step: Optional[Callable[[], None]] = None,
        host_step: Optional[HostStepSettings] = None,
        shared: Optional[Dict[str, tuple]] = None,
    ):
        self.shards, self.ddp, self.before_host_step = shards, ddp, before_host_step
        self.kind = t.optimizer
        groups = param_groups(ddp.model, t)
        factored = OPTIMIZERS[t.optimizer].factored
        pieces = {id(ms.main): Piece(tuple(ms.param.shape), ms.start, ms.end) for ms in shards}
        built: Dict[str, torch.optim.Optimizer] = {}
        builds: Dict[str, Callable[[List[dict]], torch.optim.Optimizer]] = {}  # groups -> an optimizer there
        for placement in PLACEMENTS:
            mine = [
                g
                for g in (_group_of(g, [ms for ms in shards if ms.placement == placement]) for g in groups)
                if g["params"]
            ]
            channels, shared_here = (shared or {}).get(placement, ((), {}))
            if mine or channels:  # a rank sharing pieces takes part in their sums, even with none of its own
                extra = dict(pieces=pieces, shared=shared_here, channels=channels) if factored else {}
                builds[placement] = functools.partial(make_optimizer, t=t, **extra)
                built[placement] = builds[placement](mine or [{"params": []}])
        self.device: Optional[torch.optim.Optimizer] = built.get("device")
        self.staged: Optional[StagedOptimizer] = StagedOptimizer(built["staged"]) if "staged" in built else None
        self.host: Optional[HostStepper] = None
        if "host" in built:
            self.host = self._host_stepper(built["host"], builds["host"], host_step)
        deferred = self.host.defers if self.host is not None else frozenset()
        self.deferred = [id(ms.param) in deferred for ms in shards]  # stepped, clipped, zeroed by the host step
        self._host_submitted = False
        self.whole_shards = {id(ms.param): ms for ms in shards if ms.whole}
        self.shards_of: Dict[int, List[MainShard]] = {}
        for ms in shards:
            self.shards_of.setdefault(id(ms.param), []).append(ms)
        self.state = ParamStates(self)
        self.step_count = 0  # optimizer steps taken (skipped steps excluded): the state's ``step``

    def _host_stepper(self, inner: torch.optim.Optimizer, build, settings: Optional[HostStepSettings]) -> HostStepper:
        """The host placement's step as ``settings`` say (serial over ``inner`` without them),
        connected to their link (the DDP and the offload manager call it)."""
        if settings is None:
            return SerialHostStep(inner)
        layers = {
            key: [ms for ms in self.shards if ms.placement == "host" and id(ms.param) in ids]
            for key, ids in settings.layers.items()
        }
        stepper = self._stepper_of(inner, build, settings, layers)
        settings.link.connect(stepper, layers)
        return stepper

    def _stepper_of(
        self, inner: torch.optim.Optimizer, build, settings: HostStepSettings, layers: Dict[int, list]
    ) -> HostStepper:
        if settings.how == "serial":
            return SerialHostStep(inner, layer_optimizers(build, inner, layers) if settings.by_layer else None)
        by_layer = layer_optimizers(build, inner, layers)
        buckets = {
            key: list({id(b): b for b in (self.ddp.bucket_of[id(ms.param)] for ms in held)}.values())
            for key, held in layers.items()
        }
        if settings.how == "delayed":
            return DelayedHostStep(
                inner,
                by_layer,
                layers,
                buckets,
                settings.delay_after,
                lambda: self.step_count,
                before_write=self.before_host_step,
            )
        return HostStep(inner, by_layer, layers, settings.how == "early", buckets)

    @property
    def inner(self) -> Dict[str, object]:
        """placement -> its optimizer (the host one: its ``HostStepper``), for reading state and groups."""
        return {
            placement: o
            for placement, o in (("device", self.device), ("staged", self.staged), ("host", self.host))
            if o is not None
        }

    @property
    def param_groups(self) -> list:
        """The inner optimizers' own group dicts (the LR scheduler sets their ``lr``)."""
        return [g for o in self.inner.values() for g in o.param_groups]

    @property
    def main_grads(self) -> List[torch.Tensor]:
        return [ms.grad for ms in self.shards]

    @property
    def norm_mask(self) -> List[bool]:
        return [ms.in_norm for ms in self.shards]

    @property
    def grads_to_unscale(self) -> List[torch.Tensor]:
        """The gradients the caller unscales and clips before ``step``: all but the overlapped
        host step's, which that step multiplies by the coefficient it is given."""
        return [ms.grad for ms, deferred in zip(self.shards, self.deferred, strict=True) if not deferred]

    def prepare_grads(self) -> None:
        """Point each main parameter's ``.grad`` at its (reduced) range of ``main_grad`` (the
        overlapped host step points its own, one layer at a time). Backward is over: a delayed
        host update may now be written into the weights (``HostStep.backward_done``)."""
        for ms, deferred in zip(self.shards, self.deferred, strict=True):
            if not deferred:
                ms.main.grad = ms.grad
        if self.host is not None:
            self.host.backward_done()

    def zero_grad(self) -> None:
        """Drop those ``.grad`` views before a step's backward: an fp32 weight that is its own
        main must enter it without ``.grad`` (its gradient goes to ``main_grad`` through the DDP
        hook). Until then the last step's reduced gradients stay readable, as in Megatron-LM."""
        for ms, deferred in zip(self.shards, self.deferred, strict=True):
            if not deferred:
                ms.main.grad = None

    def grads_zeroed_by_host_step(self) -> set:
        """Weights whose gradients the last submitted host step zeroes (the DDP must not zero
        them while that step may still read them); empty when no step was submitted since."""
        submitted, self._host_submitted = self._host_submitted, False
        return set(self.host.defers) if submitted else set()

    def check_finite(self, found_inf: bool) -> None:
        """Before a step is skipped: refuse if its host step already started (``HostStep.check_finite``)."""
        if self.host is not None:
            self.host.check_finite(found_inf)

    def finish_host_step(self) -> None:
        """Wait for the overlapped host step, a delayed update written into the weights (before
        reading the offloaded layers' weights or state)."""
        if self.host is not None:
            self.host.flush()

    def step(self, host_coeff: float = 1.0) -> None:
        """Step every placement's optimizer, round the mains into 16-bit weights, start the
        all-gather of updated shards (distributed optimizer). The overlapped host step is only
        started, its gradients multiplied by ``host_coeff`` first."""
        if self.device is not None:
            self.device.step()
        if self.staged is not None:
            self.staged.step()
        if self.host is not None:
            if self.before_host_step is not None:
                self.before_host_step()
            self.host.submit(host_coeff)
            self._host_submitted = True
        self.step_count += 1
        with torch.no_grad():
            for ms, deferred in zip(self.shards, self.deferred, strict=True):
                if not ms.aliases_param and not deferred:
                    ms.param.data.view(-1)[ms.start : ms.end].copy_(ms.main.reshape(-1))
        self.ddp.start_param_sync()


def _group_of(group: dict, shards: List[MainShard]) -> dict:
    """``group``'s hyperparameters over the mains of those ``shards`` whose weight is in it."""
    members = {id(p) for p in group["params"]}
    return {
        **{k: v for k, v in group.items() if k != "params"},
        "params": [ms.main for ms in shards if id(ms.param) in members],
    }


def build_mixed_precision_optimizer(
    ddp: DistributedDataParallel,
    plan: ParallelPlan,
    ps: ParallelState,
    t: TrainConfig,
    placement: Optional[Dict[int, str]] = None,
    before_host_step: Optional[Callable[[], None]] = None,
    host_step: Optional[HostStepSettings] = None,
) -> MixedPrecisionOptimizer:
    """The optimizer of this rank's shards of ``ddp``'s buffers (all of them without the
    distributed optimizer); ``placement``: id(param) -> "host" | "staged" for offloaded layers;
    ``host_step``: how to overlap the host step."""
    placement, dtype = placement or {}, DTYPES[t.main_params_dtype]
    shards = []
    for b, buf in enumerate(ddp.buffers):
        layout = buf.layout
        for index, start, end in layout.owned(buf.member):
            p, name = buf.params[index], layout.names[index]
            in_norm = plan.counts_in_norm(
                logical_name(name, p),
                getattr(p, "tp_dim", None),
                getattr(p, "expert", False),
                ps.coords,
                sharded=layout.sharded,
            )
            main = _takes_grad(_main_of(p, start, end, dtype), p.main_grad)
            shards.append(
                MainShard(
                    param=p,
                    name=name,
                    start=start,
                    end=end,
                    main=main,
                    grad=grad_range(p, start, end),
                    placement=placement.get(id(p), "device"),
                    in_norm=in_norm,
                    buffer=b,
                    bucket=layout.bucket_of(index),
                    position=layout.ranges[index][0] + start,
                )
            )
    shared = shared_pieces(ddp, shards, placement, ps.device) if OPTIMIZERS[t.optimizer].factored else None
    return MixedPrecisionOptimizer(shards, t, ddp, before_host_step, host_step, shared)


def shared_pieces(
    ddp: DistributedDataParallel, shards: List[MainShard], placement: Dict[int, str], device: torch.device
) -> Dict[str, tuple]:
    """placement -> (its ``SharedPieces``, one per sharded buffer with parameters cut between
    ranks; {id(main): (shared pieces, index)} of this rank's parts of them). Every rank of a
    buffer's group derives the same list from the layout, whether or not it holds a part."""
    mains = {(ms.buffer, id(ms.param)): ms.main for ms in shards}
    out: Dict[str, tuple] = {}
    for b, buf in enumerate(ddp.buffers):
        if not buf.layout.sharded:
            continue
        here: Dict[str, SharedPieces] = {}
        for index, p in enumerate(buf.params):
            if len(buf.layout.param_shards(index)) < 2:
                continue
            where = placement.get(id(p), "device")
            if where not in here:
                here[where] = SharedPieces(buf.group, [], device)
                channels, _ = out.setdefault(where, ([], {}))
                channels.append(here[where])
            here[where].shapes.append(tuple(p.shape))
            if (b, id(p)) in mains:
                out[where][1][id(mains[b, id(p)])] = (here[where], len(here[where].shapes) - 1)
    return {where: (tuple(channels), mine) for where, (channels, mine) in out.items()}
