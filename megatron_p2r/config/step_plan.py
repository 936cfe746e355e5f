"""The step plan: how each placement's optimizer steps, decided once from the config.

Placements (``optim/mixed_precision.py``): **device** (the resident layers: a device kernel);
**staged** (``--cpu-offload-what optimizer``: weights on the device, state on host, stepped on
host copies); **host** (``--cpu-offload-what params,grads,optimizer``: weights, mains and state on
host). The host placement steps in one of these ways (``HOST_STEPS``):

- ``serial``: after the norm, on the calling thread, before the weights are used again;
- ``overlapped`` (``--overlap-cpu-optimizer-d2h-h2d``): after the norm, on worker threads, each
  layer's next fetch waiting for its own step (``optim/host_step.py``);
- ``early``: overlapped, each layer's step started in backward as soon as its gradients are
  final — chosen when nothing global gates the update (``--clip-grad 0``, no fp16 loss scaling)
  and no layer module serves two layers (``StepPlan.host_step``);
- ``delayed`` (``--cpu-offload-delayed-param-update``): overlapped, one iteration late, after
  ``delay_warmup`` undelayed steps (``optim/delayed_update.py``).

Its mains and state are in RAM or, with ``--cpu-offload-optimizer-nvme-path``, on local NVMe
(``offload/nvme.py``). ``REFUSALS`` is the table of the combinations that are not built, each
with its reason; ``build_step_plan`` raises the first that applies. The runtime
(``offload/optimizer.py``), the planner (``planning/``) and validation read the plan and
decide nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.offload import host_optimizer_threads, parse_offload_what
from megatron_p2r.config.root import Config

HOST_STEPS = ("serial", "overlapped", "early", "delayed")


@dataclass(frozen=True)
class StepSettings:
    """The flags the refusals read, normalised: ``offloaded``: --cpu-offload-layers is given;
    ``weights_on_host``: --cpu-offload-what includes params; ``weights``/``mains``: dtypes."""

    offloaded: bool
    weights_on_host: bool
    overlap: bool
    delayed: bool  # --cpu-offload-delayed-param-update with --cpu-offload-layers (else it delays nothing)
    nvme: bool
    distributed: bool  # --use-distributed-optimizer
    weights: str  # fp32 | bf16 | fp16
    mains: str  # --main-params-dtype


@dataclass(frozen=True)
class Refusal:
    """A combination that is not built (``when``) and why (``message``)."""

    name: str
    when: Callable[[StepSettings], bool]
    message: str


# In the order they are checked: the first that applies is the error.
REFUSALS: Tuple[Refusal, ...] = (
    Refusal(
        "overlap-needs-host-weights",
        lambda s: s.overlap and not (s.offloaded and s.weights_on_host),
        "--overlap-cpu-optimizer-d2h-h2d overlaps the step of layers whose weights live on host: it needs "
        "--cpu-offload-layers with --cpu-offload-what params,grads,optimizer",
    ),
    Refusal(
        "delayed-needs-overlap",
        lambda s: s.delayed and not s.overlap,
        "--cpu-offload-delayed-param-update delays the overlapped host step: it needs --overlap-cpu-optimizer-d2h-h2d",
    ),
    Refusal(
        "delayed-with-nvme",
        lambda s: s.delayed and s.nvme,
        "--cpu-offload-delayed-param-update is not supported with --cpu-offload-optimizer-nvme-path (the NVMe "
        "state reads ahead in the undelayed order)",
    ),
    Refusal(
        "nvme-needs-host-weights",
        lambda s: s.nvme and not s.weights_on_host,
        "--cpu-offload-optimizer-nvme-path holds the optimizer state of layers whose weights live on host: it "
        "needs --cpu-offload-what params,grads,optimizer",
    ),
    Refusal(
        "overlap-with-distributed-optimizer",
        lambda s: s.overlap and s.distributed,
        "--overlap-cpu-optimizer-d2h-h2d is not supported with --use-distributed-optimizer: the all-gather of "
        "updated shards reads every weight right after the step",
    ),
    # The delayed step rewrites the mains while the next iteration reads the weights: they must differ.
    Refusal(
        "delayed-needs-16-bit-weights",
        lambda s: s.delayed and s.weights == "fp32",
        "--cpu-offload-delayed-param-update needs 16-bit weights (--bf16 or --fp16): fp32 weights are their own "
        "main parameters, which the delayed host step rewrites while the next iteration still reads them",
    ),
    Refusal(
        "delayed-with-fp16-mains-of-fp16-weights",
        lambda s: s.delayed and s.weights == s.mains == "fp16",
        "--cpu-offload-delayed-param-update is not supported with --fp16 and --main-params-dtype fp16: fp16 "
        "weights are then their own main parameters",
    ),
)


@dataclass(frozen=True)
class StepPlan:
    """How this run's optimizer steps. ``host``: how the placement whose weights live on host
    steps (``HOST_STEPS``; ``early`` is decided per stage by ``host_step``), None when no layer's
    weights do; ``staged``: some layers keep only their state on host; ``nvme_path``: the host
    step's mains and state are on that NVMe directory (None: in RAM; it holds nothing without
    offloaded layers, as in a pseudo phase planned with its real phase's flags); ``threads``: the host kernels'
    threads (--host-optimizer-threads, ``auto`` resolved for this rank); ``delay_warmup``: undelayed steps before ``delayed`` starts; ``gated``:
    clipping or fp16 loss scaling makes each step wait for the global norm."""

    host: Optional[str]
    staged: bool
    nvme_path: Optional[str]
    threads: int
    delay_warmup: int
    gated: bool

    @property
    def overlapped(self) -> bool:
        """The host step runs on worker threads (overlapped, early or delayed)."""
        return self.host in ("overlapped", "delayed")

    @property
    def delayed(self) -> bool:
        return self.host == "delayed"

    def host_step(self, layer_keys: Sequence[int]) -> Optional[str]:
        """How a stage of ``layer_keys`` (its layers' module keys) steps its host layers: an
        overlapped step starts in backward (``early``) unless a norm gates it or a module serves
        two layers (a pseudo slot's gradient is final only after its last use, which the DDP does
        not track)."""
        if self.host == "overlapped" and not self.gated and len(set(layer_keys)) == len(layer_keys):
            return "early"
        return self.host


def settings(cfg: Config) -> StepSettings:
    o, t = cfg.offload, cfg.train
    return StepSettings(
        offloaded=o.cpu_offload_layers is not None,
        weights_on_host="params" in parse_offload_what(o.cpu_offload_what),
        overlap=o.overlap_cpu_optimizer_d2h_h2d,
        delayed=o.cpu_offload_delayed_param_update and o.cpu_offload_layers is not None,
        nvme=o.cpu_offload_optimizer_nvme_path is not None,
        distributed=cfg.parallel.use_distributed_optimizer,
        weights="bf16" if t.bf16 else "fp16" if t.fp16 else "fp32",
        mains=t.main_params_dtype,
    )


def refusals(s: StepSettings) -> Tuple[Refusal, ...]:
    """Every row of ``REFUSALS`` that applies to ``s``, in order."""
    return tuple(r for r in REFUSALS if r.when(s))


def build_step_plan(cfg: Config) -> StepPlan:
    """The step plan of ``cfg``; ConfigError with the first refusal that applies."""
    s = settings(cfg)
    refused = refusals(s)
    if refused:
        raise ConfigError(refused[0].message)
    o = cfg.offload
    host = None
    if s.offloaded and s.weights_on_host:
        host = "delayed" if s.delayed else "overlapped" if s.overlap else "serial"
    return StepPlan(
        host=host,
        staged=s.offloaded and not s.weights_on_host,
        nvme_path=o.cpu_offload_optimizer_nvme_path,
        threads=host_optimizer_threads(o.host_optimizer_threads),
        delay_warmup=o.cpu_offload_delayed_param_update_warmup_steps,
        gated=cfg.train.clip_grad != 0 or cfg.train.fp16,
    )
