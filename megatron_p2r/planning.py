"""Scale on paper: what every rank of a layout holds, sends and computes, without building it.

The planner is pure accounting over a ``Config`` and a world size. It mirrors the model's
construction tensor by tensor (``stage_tensors``: names, local shapes and sharding attributes,
the same ones ``model.m6.build_model`` creates), so a meta-device build of any rank
(``tools/plan.py --verify-rank``) can check it exactly. From those tensors it derives:

- bytes per rank by category, as this project stores them: fp32 parameters that are the
  master weights (4 B), fp32 gradients (4 B), AdamW moments (8 B); with --bf16/--fp16 the
  16-bit copies autocast makes for the matmuls (held for backward, or a transient cache);
- activations held per in-flight micro-batch, counted op by op from what autograd saves in
  this code (with and without recomputation), times the micro-batches the schedule keeps in
  flight, plus the largest transient working set;
- what granular CPU offload moves to host (``optim.offload``'s own selection and accounting);
- communication volume per step of each group (tp, dp, ep, expert_dp, pp, embedding, sharing);
- an estimate of step time and of days for a token budget on a GPU preset.

Activation sizes are in bytes for CUDA kernels (bool dropout masks, fused attention without
s x s tensors); ``device_type="cpu"`` gives the CPU variant the tests measure against.
See docs/scale.md for the assumptions.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.config import (Config, global_batch_size, num_microbatches, parse_layer_spec, parse_memory_size,
                                 parse_offload_what)
from megatron_p2r.model.m6 import WORD_EMBEDDING, model_layer_keys, replica_stage_sets, stage_ranges
from megatron_p2r.parallel.state import Layout

GiB = 2 ** 30
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8   # fp32 master weight, fp32 grad, exp_avg + exp_avg_sq


# ----------------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and its links. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    memory: int              # bytes usable by the process (as nvidia-smi reports the total)
    flops16: float           # dense bf16/fp16 tensor-core FLOP/s
    flops32: float           # dense fp32 FLOP/s (TF32 off)
    hbm_bw: float            # device memory bandwidth (the optimizer step is bound by it)
    intra_node_bw: float     # NVLink, per GPU
    inter_node_bw: float     # network, per GPU (node NIC bandwidth / GPUs per node)
    host_bw: float           # PCIe host <-> device, per GPU
    gpus_per_node: int = 8
    bf16: bool = True        # V100 has fp16 tensor cores but no bf16

    def replace(self, **changes) -> "GPUSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


GPU_PRESETS: Dict[str, GPUSpec] = {
    # DGX-1V: NVLink2 6 x 25 GB/s, 4 x 100 Gb/s IB per 8 GPUs, PCIe gen3 x16.
    "V100-32GB": GPUSpec("V100-32GB", 32510 * 2**20, 125e12, 15.7e12, 900e9, 150e9, 6.25e9, 12e9, bf16=False),
    # DGX A100: NVLink3 300 GB/s, 8 x 200 Gb/s HDR, PCIe gen4.
    "A100-80GB": GPUSpec("A100-80GB", 81920 * 2**20, 312e12, 19.5e12, 2039e9, 300e9, 25e9, 25e9),
    # DGX H100: NVLink4 450 GB/s, 8 x 400 Gb/s NDR, PCIe gen5.
    "H100-80GB": GPUSpec("H100-80GB", 81559 * 2**20, 989e12, 67e12, 3350e9, 450e9, 50e9, 50e9),
    "H200-141GB": GPUSpec("H200-141GB", 143771 * 2**20, 989e12, 67e12, 4800e9, 450e9, 50e9, 50e9),
}


# ----------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class TensorSpec:
    """One parameter of one rank, as ``build_model`` creates it."""

    name: str                       # module path (the global name)
    shape: Tuple[int, ...]          # local shape on this rank
    tp_dim: Optional[int] = None
    expert: bool = False
    shared_stages: Tuple[int, ...] = ()
    shared_name: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def logical(self) -> str:
        return self.shared_name or self.name

    def global_numel(self, tp: int, ep: int) -> int:
        return self.numel * (tp if self.tp_dim is not None else 1) * (ep if self.expert else 1)


def _norm(prefix: str, m) -> List[TensorSpec]:
    out = [TensorSpec(f"{prefix}.weight", (m.hidden_size,))]
    if m.normalization == "LayerNorm":
        out.append(TensorSpec(f"{prefix}.bias", (m.hidden_size,)))
    return out


def _column(prefix: str, out_features: int, in_features: int, tp: int, bias: bool) -> List[TensorSpec]:
    specs = [TensorSpec(f"{prefix}.weight", (out_features // tp, in_features), tp_dim=0)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", (out_features // tp,), tp_dim=0))
    return specs


def _row(prefix: str, out_features: int, in_features: int, tp: int, bias: bool) -> List[TensorSpec]:
    specs = [TensorSpec(f"{prefix}.weight", (out_features, in_features // tp), tp_dim=1)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", (out_features,)))
    return specs


def layer_tensors(cfg: Config, key: int, tp: int, ep: int) -> List[TensorSpec]:
    """The parameters of transformer module ``layers.{key}`` (model/block.py, attention.py,
    mlp.py, moe/router.py, moe/experts.py)."""
    m = cfg.model
    h, bias, p = m.hidden_size, m.add_bias, f"layers.{key}"
    specs = _norm(f"{p}.input_norm", m)
    specs += _column(f"{p}.attention.qkv", 3 * h, h, tp, bias) + _row(f"{p}.attention.proj", h, h, tp, bias)
    specs += _norm(f"{p}.post_attention_norm", m)
    glu = 2 if m.swiglu else 1
    if m.is_moe_layer(key):
        e, f = m.num_experts // ep, m.expert_ffn_size // tp
        x = f"{p}.mlp.experts"
        specs.append(TensorSpec(f"{p}.mlp.router.weight", (m.num_experts, h)))
        specs.append(TensorSpec(f"{x}.weight1", (e, glu * f, h), tp_dim=1, expert=True))
        specs.append(TensorSpec(f"{x}.weight2", (e, h, f), tp_dim=2, expert=True))
        if bias:
            specs.append(TensorSpec(f"{x}.bias1", (e, glu * f), tp_dim=1, expert=True))
            specs.append(TensorSpec(f"{x}.bias2", (e, h), expert=True))
    else:
        specs += _column(f"{p}.mlp.fc1", glu * m.ffn_size, h, tp, bias) + _row(f"{p}.mlp.fc2", h, m.ffn_size, tp, bias)
    return specs


def stage_tensors(cfg: Config, tp: int, ep: int, stage: int) -> List[TensorSpec]:
    """Every parameter of pipeline stage ``stage`` on one rank (all ranks of a stage hold the
    same shapes; they differ in which TP / EP slice they hold)."""
    m = cfg.model
    ranges = stage_ranges(cfg)
    last, first = stage == len(ranges) - 1, stage == 0
    keys = model_layer_keys(cfg)
    specs: List[TensorSpec] = []
    for key in dict.fromkeys(keys[i] for i in ranges[stage]):
        specs += layer_tensors(cfg, key, tp, ep)
    if first:
        specs.append(TensorSpec(WORD_EMBEDDING, (m.padded_vocab_size // tp, m.hidden_size), tp_dim=0))
        if m.position_embedding_type == "learned_absolute":
            specs.append(TensorSpec("embedding.position_embeddings.weight", (m.max_positions, m.hidden_size)))
    if last:
        specs += _norm("final_norm", m)
        tied = not m.untie_embeddings_and_output_weights
        if not (tied and first):
            specs.append(TensorSpec("output_layer.weight", (m.padded_vocab_size // tp, m.hidden_size), tp_dim=0,
                                    shared_name=WORD_EMBEDDING if tied else None))
    shared = replica_stage_sets(cfg)
    out = []
    for s in specs:
        stages = next((st for prefix, st in shared.items()
                       if s.logical == prefix or s.logical.startswith(prefix + ".")), ())
        out.append(dataclasses.replace(s, shared_stages=tuple(stages)))
    return out


def logical_parameter_count(cfg: Config, tp: int = 1, ep: int = 1) -> int:
    """Parameters of the model, each logical tensor once (stage replicas, TP replicas and
    pseudo-phase slots counted once). Independent of the layout it is evaluated with."""
    seen: Dict[str, int] = {}
    for stage in range(len(stage_ranges(cfg))):
        for s in stage_tensors(cfg, tp, ep, stage):
            seen.setdefault(s.logical, s.global_numel(tp, ep))
    return sum(seen.values())


def expert_parameter_count(cfg: Config) -> int:
    """Logical parameters of the experts alone (weights and biases of every expert)."""
    seen = {}
    for stage in range(len(stage_ranges(cfg))):
        for s in stage_tensors(cfg, 1, 1, stage):
            if s.expert:
                seen.setdefault(s.logical, s.numel)
    return sum(seen.values())


def state_bytes(specs: Sequence[TensorSpec]) -> Dict[str, int]:
    """Bytes of parameters, gradients and AdamW moments, as ``optim.offload.state_bytes``."""
    n = sum(s.numel for s in specs)
    return {"params": PARAM_BYTES * n, "grads": GRAD_BYTES * n, "optimizer": ADAM_BYTES * n}


# ----------------------------------------------------------------------------- activations

def _cached_cast(s: TensorSpec) -> bool:
    """Whether autocast casts this parameter itself (a leaf, so cached per forward): linear
    weights and biases. Norms, embeddings and the fp32 router are not cast; stacked experts
    are cast through a transposed view, which autocast does not cache."""
    leaf = s.name.rsplit(".", 2)
    return (not s.expert and not s.name.startswith("embedding.") and "norm" not in s.name
            and not s.name.endswith("router.weight") and leaf[-1] in ("weight", "bias"))


def _matmul_weight_numel(specs: Sequence[TensorSpec]) -> int:
    """Weights autocast casts for a matmul and a saves for backward (linear weights and
    stacked expert matrices; not biases, norms, embeddings or the fp32 router)."""
    return sum(s.numel for s in specs
               if (_cached_cast(s) and s.name.endswith(".weight"))
               or (s.expert and s.name.endswith((".weight1", ".weight2"))))


@dataclass
class LayerActivations:
    held: int           # bytes autograd keeps for backward (without the 16-bit weight copies)
    casts: int          # 16-bit weight copies one call saves (autocast, no recomputation)
    cached_casts: int   # of which leaf weights: cast once per forward, held by autocast's cache
    work: int           # activation gradients alive at once in the MLP's backward
    backward: int = 0   # the MLP backward's peak on top of ``held`` (gradients minus what it freed)


def _moe_rows(cfg: Config, tokens: int) -> Tuple[int, int]:
    """(slots per token, kept assignments) for ``tokens`` tokens, with balanced routing."""
    m = cfg.model
    slots = m.moe_num_prototypes if m.moe_num_prototypes > 1 else m.moe_router_topk
    rows = tokens * slots
    if m.moe_capacity_factor is not None:
        capacity = math.ceil(m.moe_capacity_factor * tokens * slots / m.num_experts)
        rows = min(rows, capacity * m.num_experts)
    return slots, rows


def layer_activations(cfg: Config, key: int, tp: int, ep: int, *, device_type: str = "cuda") -> LayerActivations:
    """What one transformer layer (module ``key``) saves for backward, per micro-batch.

    Counted from the ops of model/block.py: the residual stream is fp32 (parameters are fp32),
    norms run in fp32 under autocast and each linear saves its (16-bit) input; attention saves
    q, k, v (views of the QKV output, or the rotated q, k), its output and log-sum-exp.
    """
    m, t = cfg.model, cfg.train
    a = 2 if (t.bf16 or t.fp16) else 4
    autocast = a == 2
    b, s, h = t.micro_batch_size, m.seq_length, m.hidden_size
    n = b * s
    specs = layer_tensors(cfg, key, tp, ep)
    norm = n * h * 4 + n * 4 * (2 if m.normalization == "LayerNorm" else 1) + \
        (n * h * 4 if m.normalization == "RMSNorm" else 0)   # torch's RMSNorm also keeps x * rstd
    held = 2 * norm
    held += n * h * a + n * 3 * h // tp * a + n * h // tp * a + b * (m.num_attention_heads // tp) * s * 4
    if m.position_embedding_type == "rope":
        held += 2 * n * h // tp * a                              # rotated q and k
    if m.attention_dropout and device_type != "cuda":
        raise ValueError("attention dropout on CPU runs the math attention kernel with s x s tensors, "
                         "which the planner does not model; plan with device_type='cuda'")
    if m.hidden_dropout:
        branch = 4 if (m.add_bias or not autocast) else a        # a bias add promotes to fp32
        held += 2 * n * h * (1 if device_type == "cuda" else branch)
    glu = 2 if m.swiglu else 1
    act_saved = 1 + (1 if m.swiglu else 0)                        # GELU out / SiLU out and product
    casts = _matmul_weight_numel(specs) * a if autocast else 0   # per call for experts, see below
    if m.is_moe_layer(key):
        slots, rows = _moe_rows(cfg, n)
        f, e_local = m.expert_ffn_size // tp, m.num_experts // ep
        held += n * h * 4 + n * m.num_experts * 4 + n * slots * 8    # router input, probs, top-k ids
        if m.moe_z_loss_coeff:
            held += n * m.num_experts * 4 + 2 * n * m.moe_num_prototypes * 4
        held += rows * 8 * (2 + (ep > 1) + m.add_bias)          # token ids, order, [perm], [expert ids]
        held += rows * h * a                                     # expert input rows
        held += rows * glu * f * a + rows * act_saved * f * a    # fc1 out, activation outputs
        held += 2 * rows * h * 4 + rows * 4     # combined rows (fp32), their weights, weighted rows (index_add)
        expert_casts = e_local * (glu + 1) * f * h * a if autocast else 0
        cached = casts - expert_casts
        work = rows * f * a * glu
        # at the expert matmuls' backward the combine side is freed; both stacked weight
        # gradients are alive (autograd accumulates them after the expert block)
        backward = work + e_local * (glu + 1) * f * h * a - (2 * rows * h * 4 + rows * 4)
    else:
        f = m.ffn_size // tp
        held += n * h * a + n * glu * f * a + n * act_saved * f * a
        cached = casts
        work = n * f * a * glu
        backward = work + h * f * a                              # fc2's weight gradient
    return LayerActivations(held=held, casts=casts, cached_casts=cached, work=work, backward=backward)


@dataclass
class StageActivations:
    """Per micro-batch, for one pipeline stage."""

    held: int              # no recomputation: everything autograd saves (without weight copies)
    head: int              # of which the final norm, output layer and loss (last stage)
    casts: int             # 16-bit weight copies saved for backward (autocast, no recomputation)
    cache: int             # autocast cache of leaf weights during one forward (recomputation)
    head_casts: int        # the output layer's 16-bit copy (not recomputed)
    layers: Dict[int, LayerActivations] = field(default_factory=dict)   # per module key, per call
    calls: Dict[int, int] = field(default_factory=dict)                 # calls per module key
    head_fwd: int = 0      # logits (and their fp32 copy) while the loss is computed
    head_bwd: int = 0      # gradients of the logits
    shared_grads: int = 0  # gradient buffers of weights used several times in one forward


def stage_activations(cfg: Config, tp: int, ep: int, stage: int, *, device_type: str = "cuda") -> StageActivations:
    m, t = cfg.model, cfg.train
    a = 2 if (t.bf16 or t.fp16) else 4
    autocast = a == 2
    b, s, h = t.micro_batch_size, m.seq_length, m.hidden_size
    n = b * s
    ranges = stage_ranges(cfg)
    first, last = stage == 0, stage == len(ranges) - 1
    keys = model_layer_keys(cfg)
    stage_keys = [keys[i] for i in ranges[stage]]
    calls = {k: stage_keys.count(k) for k in dict.fromkeys(stage_keys)}
    per = {k: layer_activations(cfg, k, tp, ep, device_type=device_type) for k in calls}
    # Always kept: the stage's output (on the last stage it is the final norm's saved input,
    # elsewhere the schedule keeps it for the backward from the next stage), rope tables,
    # the embedding's indices.
    common = 0 if last else n * h * 4
    if m.position_embedding_type == "rope":
        common += 2 * s * m.head_dim * 4
    if first:
        if m.position_embedding_type == "learned_absolute":
            common += s * 8
        if tp > 1:
            common += n * 9                                   # masked local ids (int64) + mask
        if m.hidden_dropout:
            common += n * h * (1 if device_type == "cuda" else 4)
    head = head_casts = head_fwd = head_bwd = 0
    v = m.padded_vocab_size // tp
    if last:
        head = n * h * 4 + n * 4 * (2 if m.normalization == "LayerNorm" else 1) + \
            (n * h * 4 if m.normalization == "RMSNorm" else 0)
        head += n * h * a + n * v * 4 + (n * 9 if tp > 1 else 0)
        head_casts = v * h * a if autocast else 0
        head_fwd = n * v * a + (n * v * 4 + n * h * 4 if autocast else 0)
        head_bwd = 2 * n * v * 4 if tp == 1 else n * v * 4
    specs = stage_tensors(cfg, tp, ep, stage)
    # A weight called several times in one forward gets one gradient buffer that autograd
    # accumulates into until its last use's backward: at the 16-bit cast autocast caches, or
    # in fp32 (the tied embedding: looked up in fp32, projected through its cast).
    shared = sum(s_.numel * (a if _cached_cast(s_) else 4) for s_ in specs
                 if s_.name.startswith("layers.") and calls[int(s_.name.split(".")[1])] > 1)
    if first and last and not m.untie_embeddings_and_output_weights:
        shared += 4 * (m.padded_vocab_size // tp) * h
    return StageActivations(
        held=common + head + sum(per[k].held * c for k, c in calls.items()),
        head=head,
        # leaf weights are cast once per forward (autocast's cache); expert stacks per call
        casts=sum(p.cached_casts + (p.casts - p.cached_casts) * calls[k] for k, p in per.items()) + head_casts,
        cache=sum(p.cached_casts for p in per.values()) + head_casts, head_casts=head_casts,
        layers=per, calls=calls, head_fwd=head_fwd, head_bwd=head_bwd,
        shared_grads=shared)


def in_flight(cfg: Config, layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once under the configured schedule."""
    m = num_microbatches(cfg, layout.world_size)
    if layout.pp == 1:
        return 1
    if cfg.parallel.pipeline_schedule == "gpipe":
        return m
    return min(layout.pp - stage, m)


def activation_memory(cfg: Config, layout: Layout, stage: int, *, recompute: Optional[bool] = None,
                      offloaded: Sequence[int] = (), device_type: str = "cuda") -> Dict[str, int]:
    """Peak activation bytes of a rank of ``stage``.

    ``activations``: what ``in_flight`` micro-batches keep for backward; ``compute_weights``:
    their 16-bit weight copies; ``transient``: the largest working set on top, the worst of
    (a) the forward of the loss (logits, their fp32 copy) and, under recomputation, the
    autocast cache of the stage's weights plus one layer's no-grad forward; (b) the backward
    of the loss (logit gradients); (c) the backward of the largest layer: recomputed in full
    when recomputing, plus its widest activation gradient, its largest weight gradient and
    the gradient buffers of weights called more than once (pseudo slots, tied embedding).
    Offloaded modules (``optim.offload``) always run recomputed with fetched weights.
    """
    st = stage_activations(cfg, layout.tp, layout.ep, stage, device_type=device_type)
    recompute = cfg.train.recompute_activations if recompute is None else recompute
    k = in_flight(cfg, layout, stage)
    n_h4 = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size * 4
    light = set(st.calls) if recompute else set(offloaded) & set(st.calls)
    held = st.held - sum((st.layers[key].held - n_h4) * st.calls[key] for key in light)
    casts = st.casts - sum(p.cached_casts + (p.casts - p.cached_casts) * st.calls[key]
                           for key, p in st.layers.items() if key in light)
    off = set(offloaded) & set(st.calls)
    cache = st.cache - sum(st.layers[key].cached_casts for key in off)   # fetched copies are not cached
    fwd = st.head_fwd + (cache if light else 0)
    if light:
        fwd = max(fwd, cache + 2 * max(st.layers[key].work for key in light))
    # the backward of one layer: recomputed in full (without its input, the checkpoint) when
    # light, plus the residual gradient and the MLP backward's working set
    bwd_layer = max((p.backward + n_h4 + (p.held - n_h4 + p.casts if key in light else 0)
                     for key, p in st.layers.items()), default=0) - st.head + st.shared_grads
    transient = max(fwd, st.head_bwd, bwd_layer)
    return {"held_per_microbatch": held + casts, "in_flight": k, "activations": k * held,
            "compute_weights": k * casts, "transient": transient}


# ----------------------------------------------------------------------------- offload

def offload_plan(cfg: Config, layout: Layout, stage: int) -> Dict[str, object]:
    """What ``optim.offload`` puts on host for a rank of ``stage``, with its own selection
    (``select_modules`` / ``choose_auto``) and accounting (``memory_plan``).

    ``recomputed``: modules whose weights live on host (run recomputed with fetched copies,
    moving 3 x their fp32 weights per micro-batch: fetch forward, fetch backward, gradient
    back); with --cpu-offload-what optimizer only the moments live on host and each step moves
    the weights and gradients to host and the weights back (``moved_per_step``).
    """
    from megatron_p2r.optim.offload import choose_auto, last_first, memory_plan, select_modules
    specs = stage_tensors(cfg, layout.tp, layout.ep, stage)
    total = state_bytes(specs)
    keys = model_layer_keys(cfg)
    layer_range = stage_ranges(cfg)[stage]
    stage_keys = [keys[i] for i in layer_range]
    per_module = {k: state_bytes([s for s in specs if s.name.startswith(f"layers.{k}.")])
                  for k in dict.fromkeys(stage_keys)}
    o = cfg.offload
    what = parse_offload_what(o.cpu_offload_what)
    chosen: List[int] = []
    if o.cpu_offload_layers is not None:
        spec = parse_layer_spec(o.cpu_offload_layers, cfg.model.num_layers)
        if spec.kind == "auto":
            picked = choose_auto(total, per_module, last_first(stage_keys), o.offload_prefetch,
                                 parse_memory_size(o.device_memory_budget), f"stage {stage}",
                                 o.device_memory_budget, what)
            chosen = [k for k in dict.fromkeys(stage_keys) if k in picked]
        else:
            chosen = select_modules(spec, stage_keys, layer_range)
    plan = memory_plan(total, per_module, chosen, o.offload_prefetch, what)
    layers = [layer_range.start + i for i, k in enumerate(stage_keys) if k in chosen]
    weights = sum(per_module[k]["params"] for k in chosen)
    on_host = "params" in what
    return {"modules": chosen, "layers": layers, "device": plan["device"], "host": plan["host"],
            "what": ",".join(sorted(what)), "recomputed": chosen if on_host else [],
            "host_optimizer_params": weights // PARAM_BYTES,
            "moved_per_microbatch": 3 * weights if on_host else 0, "moved_per_step": 0 if on_host else 3 * weights}


# ----------------------------------------------------------------------------- communication

def _ring(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


@dataclass
class GroupTraffic:
    """Bytes one rank sends per step over one kind of group, and the group's size/links."""

    bytes: float = 0.0
    size: int = 1
    nodes: int = 1          # nodes the group spans (1: NVLink only)
    offnode_fraction: float = 0.0   # of the bytes, the part that leaves the node (all-to-all)


def _nodes(ranks: Sequence[int], per_node: int) -> int:
    return len({r // per_node for r in ranks})


def communication(cfg: Config, layout: Layout, stage: int, gpus_per_node: int = 8,
                  offloaded: Sequence[int] = ()) -> Dict[str, GroupTraffic]:
    """Per-step bytes a rank of ``stage`` sends over each group (tp, ep, pp, dp, expert_dp,
    embedding, sharing), following the collectives the code issues (see docs/scale.md)."""
    from megatron_p2r.parallel.state import stage_set_groups
    m, t = cfg.model, cfg.train
    a = 2 if (t.bf16 or t.fp16) else 4
    n, h = t.micro_batch_size * m.seq_length, m.hidden_size
    mbs = num_microbatches(cfg, layout.world_size)
    ranges = stage_ranges(cfg)
    first, last = stage == 0, stage == len(ranges) - 1
    keys = model_layer_keys(cfg)
    stage_keys = [keys[i] for i in ranges[stage]]
    rank = layout.rank(0, 0, stage)
    T, E = layout.tp, layout.ep
    out: Dict[str, GroupTraffic] = {}

    tp_bytes = ep_bytes = 0.0
    for key in stage_keys:
        forwards = 2 if (t.recompute_activations or key in offloaded) else 1
        moe = m.is_moe_layer(key)
        tp_bytes += forwards * 2 * _ring(n * h * a, T)                 # attention proj + MLP reduce
        tp_bytes += _ring(n * h * 4, T) + _ring(n * h * (a if moe else 4), T)   # backward of the copies
        if moe:
            _, rows = _moe_rows(cfg, n)
            tp_bytes += _ring(rows * 4, T)                               # combine weights' copy
            if m.add_bias:
                tp_bytes += _ring(m.num_experts // E * h * 4, T)          # bias2's copy
            ep_bytes += (forwards + 1) * 2 * rows * h * a * (E - 1) / E   # dispatch + combine
    if first:
        tp_bytes += _ring(n * h * 4, T)                                  # vocab-parallel embedding
    if last:
        tp_bytes += _ring(n * h * 4, T) + 3 * _ring(n * 4, T)            # output copy, cross entropy
    tp_ranks = layout.group_of("tp", rank)
    out["tp"] = GroupTraffic(mbs * tp_bytes, T, _nodes(tp_ranks, gpus_per_node))
    ep_ranks = layout.group_of("ep", rank)
    same_node = sum(1 for r in ep_ranks if r // gpus_per_node == rank // gpus_per_node) - 1
    out["ep"] = GroupTraffic(mbs * ep_bytes, E, _nodes(ep_ranks, gpus_per_node),
                             1.0 - same_node / (E - 1) if E > 1 else 0.0)
    sends = (0 if last else 1) + (0 if first else 1)
    pp_nodes = 1
    if layout.pp > 1:
        neighbours = [layout.rank(0, 0, s_) for s_ in (stage - 1, stage + 1) if 0 <= s_ < layout.pp]
        pp_nodes = max(_nodes([rank, r], gpus_per_node) for r in neighbours)
    out["pp"] = GroupTraffic(mbs * sends * n * h * 4, layout.pp, pp_nodes)

    grads: Dict[str, List[float]] = {"dp": [0, layout.dp, 0], "expert_dp": [0, layout.expert_dp, 0],
                                      "embedding": [0, 1, 1], "sharing": [0, 1, 1]}
    grads["dp"][2] = _nodes(layout.group_of("dp", rank), gpus_per_node)
    grads["expert_dp"][2] = _nodes(layout.group_of("expert_dp", rank), gpus_per_node)
    for s_ in stage_tensors(cfg, T, E, stage):
        over = "expert_dp" if s_.expert else "dp"
        if s_.shared_stages:
            kind = "embedding" if s_.logical == WORD_EMBEDDING else "sharing"
            size = len(s_.shared_stages) * (layout.expert_dp if s_.expert else layout.dp)
            group = next(g for g in stage_set_groups(layout, s_.shared_stages, over) if rank in g)
            entry = grads[kind]
            entry[0] += _ring(s_.numel * GRAD_BYTES, size)
            entry[1] = max(entry[1], size)
            entry[2] = max(entry[2], _nodes(group, gpus_per_node))
        else:
            grads[over][0] += _ring(s_.numel * GRAD_BYTES, grads[over][1])
    for kind, (nbytes, size, nodes) in grads.items():
        out[kind] = GroupTraffic(nbytes, int(size), int(nodes))
    return out


# ----------------------------------------------------------------------------- time

def stage_flops_per_microbatch(cfg: Config, layout: Layout, stage: int, offloaded: Sequence[int] = ()) -> float:
    """Training FLOPs one rank of ``stage`` computes per micro-batch: 3x the forward matmuls
    (one more forward for recomputed layers), the same convention as ``metrics.model_flops_per_token``."""
    m, t = cfg.model, cfg.train
    n, h, T = t.micro_batch_size * m.seq_length, m.hidden_size, layout.tp
    ranges = stage_ranges(cfg)
    keys = model_layer_keys(cfg)
    glu = 2 if m.swiglu else 1
    total = 0.0
    for i in ranges[stage]:
        key = keys[i]
        fwd = 2 * n * 4 * h * h / T + 4 * n * m.seq_length * h / T
        if m.is_moe_layer(key):
            _, rows = _moe_rows(cfg, n)
            fwd += 2 * n * m.num_experts * h + 2 * rows * (glu + 1) * m.expert_ffn_size * h / T
        else:
            fwd += 2 * n * (glu + 1) * m.ffn_size * h / T
        total += fwd * (4 if (t.recompute_activations or key in offloaded) else 3)
    if stage == len(ranges) - 1:
        total += 3 * 2 * n * m.padded_vocab_size * h / T
    return total


def _link_time(traffic: GroupTraffic, gpu: GPUSpec) -> float:
    if traffic.bytes == 0:
        return 0.0
    if traffic.offnode_fraction:
        return traffic.bytes * (traffic.offnode_fraction / gpu.inter_node_bw
                                + (1 - traffic.offnode_fraction) / gpu.intra_node_bw)
    return traffic.bytes / (gpu.inter_node_bw if traffic.nodes > 1 else gpu.intra_node_bw)


# ----------------------------------------------------------------------------- the plan

DEVICE_ORDER = ("reserve", "params", "optimizer", "grads", "fetch_window", "compute_weights", "activations",
                "transient")


@dataclass
class StagePlan:
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


@dataclass
class Plan:
    phase: str
    world_size: int
    layout: Dict[str, int]
    gpu: Dict[str, object]
    logical_parameters: int
    expert_parameters: int
    microbatches: int
    global_batch: int
    tokens_per_step: int
    stages: List[StagePlan]
    step_time_s: float
    step_breakdown_s: Dict[str, float]
    model_flops_per_step: float
    mfu: float
    days: Optional[float]
    token_budget: Optional[float]
    host_per_node: int
    host_capacity_per_node: Optional[int]
    fits: bool
    problems: List[str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rank_ranges(layout: Layout, stage: int) -> str:
    ranks = [layout.rank(t, d, stage) for d in range(layout.dp) for t in range(layout.tp)]
    lo, hi = min(ranks), max(ranks)
    return f"{lo}-{hi}" if hi - lo + 1 == len(ranks) else ",".join(map(str, sorted(ranks)))


def make_plan(cfg: Config, world_size: int, gpu: GPUSpec, *, efficiency: float = 0.4,
              host_optimizer_bw: float = 10e9, token_budget: Optional[float] = None,
              reserve: int = GiB, host_memory_per_gpu: Optional[int] = None) -> Plan:
    """Plan every rank of ``cfg`` on ``world_size`` GPUs of kind ``gpu``.

    ``efficiency``: fraction of the GPU's peak FLOP/s the matmuls reach; ``host_optimizer_bw``:
    bytes/s of host memory one GPU's host-side AdamW streams (28 B per parameter);
    ``reserve``: CUDA context, NCCL buffers and allocator slack per GPU.
    """
    p = cfg.parallel
    layout = Layout.from_world(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                               p.expert_model_parallel_size)
    t, m = cfg.train, cfg.model
    mbs = num_microbatches(cfg, world_size)
    gbs = global_batch_size(cfg, world_size)
    problems: List[str] = []
    if not (t.bf16 or t.fp16):
        peak = gpu.flops32
    else:
        peak = gpu.flops16
        if t.bf16 and not gpu.bf16:
            problems.append(f"{gpu.name} has no bf16 tensor cores: use --fp16 (the estimate assumes fp16 speed)")
    stages: List[StagePlan] = []
    per_mb_time, grad_sync, optim_time = [], [], []
    for stage in range(layout.pp):
        specs = stage_tensors(cfg, layout.tp, layout.ep, stage)
        off = offload_plan(cfg, layout, stage)
        act = activation_memory(cfg, layout, stage, offloaded=off["recomputed"])
        act_no = activation_memory(cfg, layout, stage, recompute=False, offloaded=off["recomputed"])
        act_rc = activation_memory(cfg, layout, stage, recompute=True, offloaded=off["recomputed"])
        device = {"reserve": reserve, **off["device"],
                  "compute_weights": act["compute_weights"], "activations": act["activations"],
                  "transient": act["transient"]}
        total = sum(device.values())
        overflow, running = None, 0
        for cat in DEVICE_ORDER:
            running += device[cat]
            if running > gpu.memory:
                overflow = cat
                break
        comm = communication(cfg, layout, stage, gpu.gpus_per_node, off["recomputed"])
        flops = stage_flops_per_microbatch(cfg, layout, stage, off["recomputed"])
        compute = flops / (peak * efficiency)
        tp_t, ep_t, pp_t = (_link_time(comm[k], gpu) / mbs for k in ("tp", "ep", "pp"))
        transfer = off["moved_per_microbatch"] / gpu.host_bw
        mb_time = max(compute + tp_t + ep_t, transfer) + pp_t
        sync = sum(_link_time(comm[k], gpu) for k in ("dp", "expert_dp", "embedding", "sharing"))
        hosted = off["host_optimizer_params"]
        opt = max(28 * (sum(s.numel for s in specs) - hosted) / gpu.hbm_bw,
                  28 * hosted / host_optimizer_bw + off["moved_per_step"] / gpu.host_bw)
        per_mb_time.append(mb_time)
        grad_sync.append(sync)
        optim_time.append(opt)
        stages.append(StagePlan(
            stage=stage, ranks=_rank_ranges(layout, stage), parameters=sum(s.numel for s in specs),
            tensors=len(specs), device=device, host=off["host"], offloaded_layers=off["layers"],
            offloaded_what=off["what"],
            activations_no_recompute=act_no["activations"] + act_no["compute_weights"] + act_no["transient"],
            activations_recompute=act_rc["activations"] + act_rc["compute_weights"] + act_rc["transient"],
            in_flight=act["in_flight"], comm_bytes={k: v.bytes for k, v in comm.items()},
            time_s={"compute_per_microbatch": compute, "tp_per_microbatch": tp_t, "ep_per_microbatch": ep_t,
                    "pp_per_microbatch": pp_t, "offload_transfer_per_microbatch": transfer,
                    "grad_sync": sync, "optimizer": opt},
            device_total=total, fits=overflow is None, overflow=overflow))
        if overflow:
            worst = max(device, key=device.get)
            problems.append(f"does not fit: rank {layout.rank(0, 0, stage)} (stage {stage}, ranks "
                            f"{stages[-1].ranks}) needs {total / GiB:.2f} GiB of {gpu.memory / GiB:.2f} GiB on "
                            f"{gpu.name}; it overflows at '{overflow}' (largest category: '{worst}', "
                            f"{device[worst] / GiB:.2f} GiB)")
    pipeline = (mbs + layout.pp - 1) * max(per_mb_time)
    breakdown = {"pipeline": pipeline, "grad_sync": max(grad_sync), "optimizer": max(optim_time)}
    step = sum(breakdown.values())
    from megatron_p2r.metrics import model_flops_per_token
    tokens = gbs * m.seq_length
    model_flops = model_flops_per_token(m) * tokens
    mfu = model_flops / (step * world_size * peak)
    host_per_node = 0
    for node in range(0, world_size, gpu.gpus_per_node):
        ranks = range(node, min(node + gpu.gpus_per_node, world_size))
        host_per_node = max(host_per_node, sum(sum(stages[layout.coords(r).pp].host.values()) for r in ranks))
    host_cap = host_memory_per_gpu * gpu.gpus_per_node if host_memory_per_gpu else None
    if host_cap is not None and host_per_node > host_cap:
        problems.append(f"does not fit on host: a node holds {host_per_node / GiB:.1f} GiB of offloaded state, "
                        f"more than {host_cap / GiB:.1f} GiB ({gpu.gpus_per_node} x --host-memory)")
    days = token_budget / tokens * step / 86400 if token_budget else None
    return Plan(phase=cfg.p2r.p2r_phase, world_size=world_size,
                layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
                        "expert_dp": layout.expert_dp},
                gpu=dataclasses.asdict(gpu), logical_parameters=logical_parameter_count(cfg),
                expert_parameters=expert_parameter_count(cfg), microbatches=mbs, global_batch=gbs,
                tokens_per_step=tokens, stages=stages, step_time_s=step, step_breakdown_s=breakdown,
                model_flops_per_step=model_flops, mfu=mfu, days=days, token_budget=token_budget,
                host_per_node=host_per_node, host_capacity_per_node=host_cap,
                fits=not any(p_.startswith("does not fit") for p_ in problems), problems=problems)
