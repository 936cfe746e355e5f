"""The planner's estimate of a whole run: per-stage memory, communication and time, whether it
fits, and days for a token budget (``tools/plan.py`` prints it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.config import Config, ConfigError, build_step_plan, global_batch_size, num_microbatches
from megatron_p2r.config.schedule import COMBINED
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.metrics import model_flops_per_token
from megatron_p2r.pipeline.order import combined_step_slots, combined_warmup, step_slots
from megatron_p2r.planning.activations import activation_memory, recomputed_positions, with_recompute
from megatron_p2r.planning.checkpoint_cost import FS_WRITE_BW, Bandwidths, async_save_host_bytes, checkpoint_cost
from megatron_p2r.planning.communication import GroupTraffic, communication
from megatron_p2r.planning.hardware import GPU_HOSTS, HOST_PRESETS, NVME_PRESETS, GiB, GPUSpec, HostSpec, NvmeSpec
from megatron_p2r.planning.host_step import host_bandwidth, setting_bytes, step_setting, threads_per_rank
from megatron_p2r.planning.memory import (
    active_parameter_count,
    expert_parameter_count,
    mtp_parameter_count,
    logical_parameter_count,
    offload_plan,
    stage_state_bytes,
    stepped_elements,
)
from megatron_p2r.planning.timing import link_time, microbatch_link_times, stage_flops_per_microbatch
from megatron_p2r.planning.verdict import TierVerdict, gpu_tier, host_problem, host_tier, node_tier, nvme_problem

# "buffers": the routers' expert-bias buffers, only with --moe-router-enable-expert-bias
DEVICE_ORDER = ("reserve", "params", "buffers", "optimizer", "grads", "fetch_window", "activations", "transient")


def step_bytes_per_element(cfg: Config, plan: ParallelPlan) -> int:
    """Bytes an optimizer step streams per stepped element, on the device as on the host: what
    its kernel moves (``optim/traffic.py``) for ``cfg``'s optimizer and dtypes."""
    return setting_bytes(step_setting(cfg, plan))


@dataclass
class StageEstimate:
    stage: int
    ranks: str
    parameters: int
    tensors: int
    device: Dict[str, int]
    host: Dict[str, int]
    offloaded_layers: List[int]
    offloaded_what: str
    activations_no_recompute: int
    activations_recompute: int
    in_flight: int
    comm_bytes: Dict[str, float]
    time_s: Dict[str, float]
    device_total: int = 0
    fits: bool = True
    overflow: Optional[str] = None
    nvme: int = 0  # bytes of optimizer state on local NVMe (--cpu-offload-optimizer-nvme-path)
    host_step: Optional[dict] = None  # the host step's bandwidth and its inputs (planning/host_step.py)
    warning: Optional[str] = None  # a host-step variant that makes the step slower


@dataclass
class Plan:
    phase: str
    world_size: int
    layout: Dict[str, int]
    gpu: Dict[str, object]
    logical_parameters: int
    expert_parameters: int
    active_parameters: int  # what one token meets, the MTP depths aside (memory.active_parameter_count)
    mtp_parameters: int
    microbatches: int
    global_batch: int
    tokens_per_step: int
    stages: List[StageEstimate]
    step_time_s: float
    step_breakdown_s: Dict[str, float]
    pipeline_bubble: float  # idle time of the pipeline over its busy time: (P-1)/m, (P-1)/(v m) interleaved
    pipeline_stage: int  # the slowest stage per micro-batch, which sets the pipeline's time (the first of equals)
    model_flops_per_step: float
    mfu: float
    days: Optional[float]
    token_budget: Optional[float]
    host_per_node: int
    host_capacity_per_node: int
    tiers: Dict[str, TierVerdict]  # "gpu", "host": need, capacity and overflow of each memory tier
    fits: bool
    problems: List[str]
    checkpoint: Optional[dict] = None  # planning/checkpoint_cost.py
    nvme: Optional[dict] = None  # the node's local NVMe (per_node, bw) with --cpu-offload-optimizer-nvme-path
    warnings: List[str] = dataclasses.field(default_factory=list)  # what does not stop it, but costs time

    def to_dict(self) -> dict:
        """As a dict; ``nvme`` (the plan's, a stage's) only when something is on NVMe, a stage's
        ``host_step`` only when it steps on host, ``warnings`` only when there are some."""
        out = dataclasses.asdict(self)
        for key in ("nvme", "warnings"):
            if not out[key]:
                del out[key]
        for stage in out["stages"]:
            for key in ("nvme", "host_step", "warning"):
                if not stage[key]:
                    del stage[key]
        return out


def _rank_ranges(layout: Layout, stage: int) -> str:
    ranks = [layout.replica_rank(t, d, stage) for d in range(layout.dp_cp) for t in range(layout.tp)]
    lo, hi = min(ranks), max(ranks)
    return f"{lo}-{hi}" if hi - lo + 1 == len(ranks) else ",".join(map(str, sorted(ranks)))


@dataclass(frozen=True)
class Assumptions:
    """What the estimate assumes beyond the config: see ``make_plan``."""

    gpu: GPUSpec
    host: HostSpec
    efficiency: float = 0.4
    host_optimizer_bw: Optional[float] = None  # --host-optimizer-bw: replaces the host model's bandwidth
    reserve: int = GiB
    nvme: Optional[NvmeSpec] = None


def _peak_flops(cfg: Config, gpu: GPUSpec, problems: List[str]) -> float:
    t = cfg.train
    if not (t.bf16 or t.fp16):
        return gpu.flops32
    if t.bf16 and not gpu.bf16:
        problems.append(f"{gpu.name} has no bf16 tensor cores: use --fp16 (the estimate assumes fp16 speed)")
    return gpu.flops16


def _overflow(device: Dict[str, int], memory: int) -> Optional[str]:
    """The first category (in allocation order) at which the device's memory runs out."""
    running = 0
    for cat in DEVICE_ORDER:
        running += device.get(cat, 0)
        if running > memory:
            return cat
    return None


def _exposed_sync(cfg: Config, plan: ParallelPlan, stage: int, sync: float, compute: float) -> float:
    """The part of the gradient reduction (and weight all-gather) a step waits for: all of it,
    or with --overlap-grad-reduce what does not fit under the last micro-batch's backward (2/3
    of its compute; with --overlap-param-gather also the next forward's 1/3), and at least the
    share of each buffer's last bucket, which is only final when backward ends."""
    p = cfg.parallel
    if not p.overlap_grad_reduce or sync == 0:
        return sync
    window = compute * (2 / 3 + (1 / 3 if p.overlap_param_gather else 0))
    last = max((b.buckets[-1].end - b.buckets[-1].start) / b.numel for b in plan.grad_buffers(stage) if b.numel)
    return max(sync - window, sync * last)


def _sync_time(
    cfg: Config, plan: ParallelPlan, stage: int, comm: Dict[str, GroupTraffic], gpu: GPUSpec, compute: float
) -> float:
    """What a step waits for between backward and the optimizer step: the exposed part of the
    gradient reduction (``_exposed_sync``) and, with the expert bias, the all-reduce of the
    routers' counts, which runs after it (``training/step.py``) and is never overlapped."""
    grads = sum(link_time(comm[k], gpu) for k in ("dp", "expert_dp", "embedding", "sharing", "tp_partial"))
    bias = link_time(comm["expert_bias"], gpu) if "expert_bias" in comm else 0.0
    return _exposed_sync(cfg, plan, stage, grads, compute) + bias


def exposed_p2p(p2p: float, compute: float) -> float:
    """The part of a micro-batch's pipeline transfers (``p2p`` seconds) a rank waits for when
    each op's receives are posted while the op before it computes (--overlap-p2p-communication):
    in 1F1B's steady state half of them travel during a forward (1/3 of ``compute``), half
    during a backward (2/3), and only what outlasts that op is exposed."""
    return max(p2p / 2 - compute / 3, 0.0) + max(p2p / 2 - 2 * compute / 3, 0.0)


def exposed_ep(ep: float, compute: float, microbatches: int, unpaired: float = 1, recomputed: float = 0.0) -> float:
    """The part of a micro-batch's expert all-to-alls (``ep`` seconds, half in its forward, half
    in its backward) a step waits for, per micro-batch, when the forward of one micro-batch runs
    with the backward of another (--overlap-moe-expert-parallel-comm): the forward's all-to-alls
    travel under the other micro-batch's backward, the backward's under its forward, and what
    outlasts them is exposed; the ``unpaired`` warm-up forwards and as many cool-down backwards
    have nothing to hide under (one of each on one stage; the combined 1F1B warm-up,
    ``order.combined_warmup``, under pipeline parallelism). The forward is 1/3 of ``compute`` and
    the backward 2/3, or with a share ``recomputed`` of the layers recomputed in full, whose
    backward runs their forward again, 1/(3 + recomputed) and the rest (the recomputed
    all-to-alls' results are kept: ``ep`` is still one forward's and one backward's)."""
    forward = compute / (3 + recomputed)
    paired = max(ep / 2 - (compute - forward), 0.0) + max(ep / 2 - forward, 0.0)
    return (unpaired * ep + (microbatches - unpaired) * paired) / microbatches


def overlapped_optimizer_time(
    device_step: float,
    host_step: float,
    layer_keys: Sequence[int],
    offloaded: Sequence[int],
    layer_forward: float,
    early: bool = False,
) -> float:
    """The optimizer's share of a step when the host step overlaps what follows it
    (--overlap-cpu-optimizer-d2h-h2d): by how long the next step's first micro-batch forward ends
    later than it would with no optimizer at all, counted from the end of backward.

    The host steps the offloaded layers one after another (``host_step`` split evenly: host
    memory bandwidth is the limit, however many threads share it), after the norm in forward
    order, or with ``early`` (``StepPlan.host_step``: config/step_plan.py) each as soon as the last
    micro-batch's backward has produced its gradients: in backward order, a layer's backward
    taking two ``layer_forward`` (three when recomputed: the offloaded layers). Meanwhile the
    resident step runs on the device, then the forward, one ``layer_forward`` per layer, reaches
    each offloaded layer no earlier than that layer's step ends. Only that micro-batch's forward
    can hide the host step: the next one needs every layer stepped."""
    per_layer, step_end = host_step / len(set(offloaded)), {}
    if early:
        backward = [(key, layer_forward * (3 if key in offloaded else 2)) for key in reversed(layer_keys)]
        ready = worker = -sum(t for _, t in backward)
        for key, t in backward:
            ready += t
            if key in offloaded:
                worker = step_end[key] = max(worker, ready) + per_layer
    else:
        worker = 0.0
        for key in dict.fromkeys(k for k in layer_keys if k in offloaded):  # a pseudo slot: once, before first use
            worker = step_end[key] = worker + per_layer
    now = device_step
    for key in layer_keys:
        now = max(now, step_end.pop(key, now)) + layer_forward
    return now - layer_forward * len(layer_keys)


def delayed_update_time(
    device_step: float,
    host_step: float,
    write: float,
    window: float,
    layer_keys: Sequence[int],
    offloaded: Sequence[int],
    layer_forward: float,
) -> float:
    """The optimizer's share of a step with --cpu-offload-delayed-param-update
    (``optim/delayed_update.py``): the host step of iteration t runs during iteration t+1,
    after the write of iteration t-1's update (``write``: rounding the mains into the weights),
    so only what the two exceed of the iteration's compute (``window``) is exposed; the write of
    iteration t's update then overlaps the resident step and the next forward, layer by layer, as
    the undelayed host step does (``overlapped_optimizer_time``)."""
    excess = max(0.0, write + host_step - window)
    return excess + overlapped_optimizer_time(device_step, write, layer_keys, offloaded, layer_forward)


def _overlapped_optimizer(
    plan: ParallelPlan,
    stage: int,
    off: dict,
    steps: Tuple[float, float],
    microbatch: float,
    window: float,
    bw: float,
    early: bool,
    delayed: bool,
) -> Tuple[float, Dict[str, float]]:
    """(the optimizer's share of a step, its named parts) with --overlap-cpu-optimizer-d2h-h2d:
    ``steps``: the device and host steps' times; ``microbatch``: a micro-batch's forward and
    backward; ``window``: the stage's compute in an iteration; ``bw``: the host step's bytes/s;
    ``early``: the host step starts in backward; ``delayed``: --cpu-offload-delayed-param-update.
    ``host_optimizer_hidden``: what it hides of its host step, never negative."""
    device_step, host_step = steps
    keys, recomputed = plan.stage(stage).layer_keys, off["recomputed"]
    layer_forward = microbatch / (3 * len(keys) + len(recomputed))
    times: Dict[str, float] = {}
    if delayed:
        write = (off["host"]["params"] + plan.buffers.main_bytes * off["host_optimizer_params"]) / bw
        opt = delayed_update_time(device_step, host_step, write, window, keys, recomputed, layer_forward)
        times["host_optimizer_delayed_write"] = write
    else:
        opt = overlapped_optimizer_time(device_step, host_step, keys, recomputed, layer_forward, early=early)
    times["host_optimizer_hidden"] = max(max(device_step, host_step) - opt, 0.0)
    return opt, times


def nvme_step_time(host_step: float, nvme_bytes: int, layers: int, nvme_bw: float) -> float:
    """The host step (``host_step`` seconds from RAM) with its mains and state on local NVMe
    (offload/nvme.py): layer by layer, each layer's pages read ahead while the one before steps
    and written back by the kernel meanwhile, so each layer takes the longer of its step and its
    disk traffic (reading and writing its bytes, ``nvme_bw``); the first layer's read is exposed."""
    step, disk = host_step / layers, 2 * nvme_bytes / layers / nvme_bw
    return disk / 2 + layers * max(step, disk)


def _stage_estimate(
    cfg: Config, plan: ParallelPlan, stage: int, a: Assumptions, peak: float
) -> Tuple[StageEstimate, float]:
    """(the stage's estimate, its time per micro-batch)."""
    gpu, layout = a.gpu, plan.layout
    mbs = num_microbatches(cfg, layout.world_size)
    specs = plan.tensors(stage)
    off = offload_plan(cfg, plan, stage)
    act = activation_memory(cfg, plan, stage, offloaded=off["recomputed"])
    act_no = activation_memory(with_recompute(cfg, None), plan, stage, offloaded=off["recomputed"])
    act_rc = activation_memory(with_recompute(cfg, "full"), plan, stage, offloaded=off["recomputed"])
    device = {"reserve": a.reserve, **off["device"], "activations": act["activations"], "transient": act["transient"]}
    overflow = _overflow(device, gpu.memory)
    comm = communication(cfg, plan, stage, gpu.gpus_per_node, off["recomputed"])
    compute = stage_flops_per_microbatch(cfg, plan, stage, off["recomputed"]) / (peak * a.efficiency)
    tp_t, ep_t, pp_t, cp = microbatch_link_times(cfg, plan, stage, comm, gpu, peak * a.efficiency)
    transfer = off["moved_per_microbatch"] / gpu.host_bw
    overlap_p2p, overlap_ep = plan.schedule.posts_receives_ahead, plan.schedule.kind == COMBINED
    if overlap_ep:  # the combined warm-up's chunk forwards, in micro-batches
        unpaired = combined_warmup(layout.pp, plan.num_model_chunks, mbs, stage) / plan.num_model_chunks
        recomputed = len(recomputed_positions(cfg, plan.stage(stage), off["recomputed"])) / len(
            plan.stage(stage).layer_keys
        )
        ep_exposed = exposed_ep(ep_t, compute + tp_t, mbs, unpaired, recomputed)
    else:
        ep_exposed = ep_t
    pp_exposed = exposed_p2p(pp_t, compute + tp_t + ep_exposed) if overlap_p2p else pp_t
    mb_time = max(compute + tp_t + ep_exposed, transfer) + pp_exposed
    sync = _sync_time(cfg, plan, stage, comm, gpu, compute)
    hosted = off["host_optimizer_params"]
    per_element = step_bytes_per_element(cfg, plan)
    state = stage_state_bytes(plan, stage)
    stepped = stepped_elements(state)
    save_copy = round(
        max((b for r, b in async_save_host_bytes(cfg, layout).items() if layout.coords(r).pp == stage), default=0)
    )  # the stage's rank that copies the most
    device_step = per_element * (stepped - hosted) / gpu.hbm_bw
    opt, times, host, warning = _optimizer_time(
        cfg, plan, stage, off, a, (device_step, per_element * hosted), (mbs, compute + tp_t + ep_exposed, mbs * mb_time)
    )
    est = StageEstimate(
        stage=stage,
        ranks=_rank_ranges(layout, stage),
        parameters=sum(s.numel for s in specs),
        tensors=len(specs),
        device=device,
        host={**off["host"], **({"async_save_copy": save_copy} if save_copy else {})},
        offloaded_layers=off["layers"],
        offloaded_what=off["what"],
        activations_no_recompute=act_no["activations"] + act_no["transient"],
        activations_recompute=act_rc["activations"] + act_rc["transient"],
        in_flight=act["in_flight"],
        comm_bytes={k: v.bytes for k, v in comm.items()},
        time_s={
            "compute_per_microbatch": compute,
            "tp_per_microbatch": tp_t - cp["cp_exposed_per_microbatch"],
            "ep_per_microbatch": ep_t,
            "pp_per_microbatch": pp_t,
            **cp,
            "offload_transfer_per_microbatch": transfer,
            "grad_sync": sync,
            "optimizer": opt,
            **times,
            **({"pp_hidden_per_microbatch": pp_t - pp_exposed} if overlap_p2p else {}),
            **({"ep_hidden_per_microbatch": ep_t - ep_exposed} if overlap_ep else {}),
        },
        device_total=sum(device.values()),
        fits=overflow is None,
        overflow=overflow,
        nvme=off["nvme"],
        host_step=host,
        warning=warning,
    )
    return est, mb_time


def _optimizer_time(
    cfg: Config,
    plan: ParallelPlan,
    stage: int,
    off: dict,
    a: Assumptions,
    work: Tuple[float, float],
    timing: Tuple[int, float, float],
):
    """(the optimizer's share of a step, its named times, the host step's bandwidth and inputs,
    a warning or None). ``work``: the device step's seconds and the host step's bytes;
    ``timing``: micro-batches, a micro-batch's compute, the iteration's compute. The host step
    shares the DRAM with what runs beside it: a serial step with nothing of the offload copies,
    an overlapped one with the next forward's fetches, a delayed one with the whole iteration's
    copies (and each with its NVMe traffic). Where the overlap or the delay makes the step
    slower than the variant without it, the warning says so (``host_optimizer_variant_cost``)."""
    (device_step, step_bytes), (mbs, microbatch, window) = work, timing
    how = build_step_plan(cfg).host_step(plan.stage(stage).layer_keys) if off["recomputed"] else None
    overlap, delayed, early = how in ("overlapped", "early", "delayed"), how == "delayed", how == "early"
    iteration = off["moved_per_microbatch"] * mbs + off["moved_per_step"]
    copies = {"serial": 0, "overlapped": off["host"].get("params", 0) + off["moved_per_step"], "delayed": iteration}

    def host_time(variant: str):
        host, t = None, off["moved_per_step"] / a.gpu.host_bw
        if step_bytes:
            host = _host_bandwidth(cfg, plan, off, step_bytes, copies[variant], a)
            t += step_bytes / host["bw"]
        times = {"host_optimizer_step": t} if step_bytes else {}
        if off["nvme"]:
            times.update(
                host_optimizer_from_ram=t,
                host_optimizer_from_nvme=nvme_step_time(t, off["nvme"], len(off["modules"]), a.nvme.bw),
            )
        return times.get("host_optimizer_from_nvme", t), times, host

    def optimizer(variant: str):
        host_step, times, host = host_time(variant)
        if variant == "serial":
            return max(device_step, host_step), times, host
        opt, more = _overlapped_optimizer(
            plan,
            stage,
            off,
            (device_step, host_step),
            microbatch,
            window,
            host["bw"] if host else math.inf,
            early,
            variant == "delayed",
        )
        return opt, {**times, **more}, host

    variant = "delayed" if delayed else "overlapped" if overlap else "serial"
    opt, times, host = optimizer(variant)
    if variant == "serial":
        return opt, times, host, None
    without = "overlapped" if delayed else "serial"
    cost = opt - optimizer(without)[0]
    if cost <= 0:
        return opt, times, host, None
    times["host_optimizer_variant_cost"] = cost
    flag = "--cpu-offload-delayed-param-update" if delayed else "--overlap-cpu-optimizer-d2h-h2d"
    return (
        opt,
        times,
        host,
        (
            f"stage {stage}: {flag} makes the optimizer step {cost:.3g} s slower than the "
            f"{'undelayed overlapped' if delayed else 'serial'} step (the host step shares the "
            f"DRAM with the offload copies beside it, or outlasts the iteration): leave it off"
        ),
    )


def _host_bandwidth(
    cfg: Config, plan: ParallelPlan, off: dict, step_bytes: float, copies: float, a: Assumptions
) -> dict:
    """``host_step.host_bandwidth`` for a stage's host step beside ``copies`` bytes of offload
    copies and its NVMe reads and writes."""
    ranks = a.gpu.gpus_per_node
    other = copies + 2 * off["nvme"]
    return host_bandwidth(
        step_setting(cfg, plan),
        a.host,
        threads_per_rank(cfg.offload.host_optimizer_threads, a.host, ranks),
        ranks,
        step_bytes,
        other,
        a.host_optimizer_bw,
    )


def _overflow_problem(est: StageEstimate, layout: Layout, gpu: GPUSpec) -> str:
    worst = max(est.device, key=est.device.get)
    return (
        f"does not fit: rank {layout.rank(0, 0, est.stage)} (stage {est.stage}, ranks {est.ranks}) needs "
        f"{est.device_total / GiB:.2f} GiB of {gpu.memory / GiB:.2f} GiB on {gpu.name}; it overflows at "
        f"'{est.overflow}' (largest category: '{worst}', {est.device[worst] / GiB:.2f} GiB)"
    )


def _assumptions(
    cfg: Config,
    gpu: GPUSpec,
    efficiency: float,
    host: Optional[HostSpec],
    host_optimizer_bw: Optional[float],
    reserve: int,
    nvme: Optional[NvmeSpec],
) -> Assumptions:
    """``make_plan``'s inputs, the presets' where not given; refuses a plan missing a host or NVMe figure."""
    if host is None and gpu.name not in GPU_HOSTS:
        raise ConfigError(f"no host node for {gpu.name}: give --host-node or --host-calibration")
    a = Assumptions(
        gpu=gpu,
        host=host or HOST_PRESETS[GPU_HOSTS[gpu.name]],
        efficiency=efficiency,
        host_optimizer_bw=host_optimizer_bw,
        reserve=reserve,
        nvme=nvme or NVME_PRESETS.get(gpu.name),
    )
    if cfg.offload.cpu_offload_optimizer_nvme_path is not None and a.nvme is None:
        raise ConfigError(
            f"--cpu-offload-optimizer-nvme-path: no NVMe figures for {gpu.name}: give --nvme-per-node and --nvme-bw"
        )
    return a


def _step_slots(plan: ParallelPlan, microbatches: int) -> float:
    """A step in micro-batch slots under the schedule the config chose (``plan.schedule``)."""
    if plan.schedule.kind == COMBINED:
        return combined_step_slots(plan.layout.pp, plan.num_model_chunks, microbatches)
    return step_slots(plan.schedule.order, plan.layout.pp, plan.num_model_chunks, microbatches)


def _tiers(stages: List[StageEstimate], layout: Layout, a: Assumptions, problems: List[str]) -> Dict[str, TierVerdict]:
    """Whether the GPUs, each node's host memory and (when used) its NVMe fit; each overflow's
    problem appended to ``problems``."""
    gpu = a.gpu
    tiers = {
        "gpu": gpu_tier([s.device_total for s in stages], layout, gpu),
        "host": host_tier([sum(s.host.values()) for s in stages], layout, gpu),
    }
    if not tiers["host"].fits:
        problems.append(host_problem(tiers["host"]))
    if any(s.nvme for s in stages):
        tiers["nvme"] = node_tier("NVMe", [s.nvme for s in stages], layout, gpu.gpus_per_node, a.nvme.per_node)
        problems += [] if tiers["nvme"].fits else [nvme_problem(tiers["nvme"])]
    return tiers


def make_plan(
    cfg: Config,
    world_size: int,
    gpu: GPUSpec,
    *,
    efficiency: float = 0.4,
    host: Optional[HostSpec] = None,
    host_optimizer_bw: Optional[float] = None,
    token_budget: Optional[float] = None,
    reserve: int = GiB,
    fs_write_bw: float = FS_WRITE_BW,
    fs_node_write_bw: Optional[float] = None,
    nvme: Optional[NvmeSpec] = None,
) -> Plan:
    """Plan every rank of ``cfg`` on ``world_size`` GPUs of kind ``gpu``.

    ``efficiency``: fraction of the GPU's peak FLOP/s the matmuls reach; ``host``: the node's
    CPUs and DRAM for the host optimizer step (default: ``gpu``'s preset's node,
    ``hardware.GPU_HOSTS``; ``host_step.load_calibration`` for a measured host);
    ``host_optimizer_bw``: bytes/s one GPU's host step streams, replacing the host model;
    ``reserve``: CUDA context, NCCL buffers and allocator slack per GPU. Host memory is
    ``gpu``'s node's (``GPUSpec.with_node`` overrides it). ``fs_write_bw`` / ``fs_node_write_bw``:
    the filesystem's write bytes/s, aggregate and per node (default: the node's network).
    ``nvme``: the node's local NVMe (default: ``gpu``'s preset's), for --cpu-offload-optimizer-nvme-path.
    """
    plan = ParallelPlan.for_world(cfg, world_size)
    layout, m = plan.layout, cfg.model
    a = _assumptions(cfg, gpu, efficiency, host, host_optimizer_bw, reserve, nvme)
    problems: List[str] = []
    peak = _peak_flops(cfg, gpu, problems)
    estimates = [_stage_estimate(cfg, plan, stage, a, peak) for stage in range(layout.pp)]
    stages = [est for est, _ in estimates]
    problems += [_overflow_problem(est, layout, gpu) for est in stages if est.overflow]
    warnings = [est.warning for est in stages if est.warning]
    mbs, gbs = num_microbatches(cfg, world_size), global_batch_size(cfg, world_size)
    slots = _step_slots(plan, mbs)
    breakdown = {
        "pipeline": slots * max(t for _, t in estimates),
        "grad_sync": max(s.time_s["grad_sync"] for s in stages),
        "optimizer": max(s.time_s["optimizer"] for s in stages),
    }
    step = sum(breakdown.values())
    tokens = gbs * m.seq_length
    model_flops = model_flops_per_token(m) * tokens
    tiers = _tiers(stages, layout, a, problems)
    on_nvme = dataclasses.asdict(a.nvme) if "nvme" in tiers else None
    node_write = fs_node_write_bw or gpu.inter_node_bw * gpu.gpus_per_node
    bandwidths = Bandwidths(fs_write=fs_write_bw, fs_node_write=node_write, host=gpu.host_bw)
    return Plan(
        phase=cfg.p2r.p2r_phase,
        world_size=world_size,
        layout={k: getattr(layout, k) for k in ("tp", "cp", "pp", "dp", "ep", "expert_dp")},
        gpu=dataclasses.asdict(gpu),
        logical_parameters=logical_parameter_count(plan),
        expert_parameters=expert_parameter_count(plan),
        active_parameters=active_parameter_count(plan),
        mtp_parameters=mtp_parameter_count(plan),
        microbatches=mbs,
        global_batch=gbs,
        tokens_per_step=tokens,
        stages=stages,
        step_time_s=step,
        step_breakdown_s=breakdown,
        pipeline_bubble=slots / mbs - 1,
        pipeline_stage=max(range(len(estimates)), key=lambda stage: estimates[stage][1]),
        model_flops_per_step=model_flops,
        mfu=model_flops / (step * world_size * peak),
        days=token_budget / tokens * step / 86400 if token_budget else None,
        token_budget=token_budget,
        host_per_node=tiers["host"].need,
        host_capacity_per_node=tiers["host"].capacity,
        tiers=tiers,
        fits=all(t.fits for t in tiers.values()),
        problems=problems,
        checkpoint=checkpoint_cost(cfg, layout, gpu.gpus_per_node, bandwidths),
        nvme=on_nvme,
        warnings=warnings,
    )
