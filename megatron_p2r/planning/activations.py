"""Activation memory: what autograd keeps per micro-batch, counted op by op from this code.

Activations held per in-flight micro-batch (with and without recomputation), at the point of
the schedule (``pipeline.order``) where the most are in flight, plus the largest transient
working set; with
--bf16/--fp16 the 16-bit weight copies autocast makes for the matmuls. Sizes are in bytes for
CUDA kernels (bool dropout masks, fused attention without s x s tensors); ``device_type="cpu"``
gives the CPU variant the tests measure against. See docs/scale.md for the assumptions.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.tensors import TensorSpec, layer_tensors
from megatron_p2r.pipeline.order import Op, max_outstanding, pipeline_ops
from megatron_p2r.pipeline.transfers import link_buffers


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


def moe_rows(cfg: Config, tokens: int) -> Tuple[int, int]:
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
    specs = layer_tensors(cfg.model, key, tp, ep)
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
        slots, rows = moe_rows(cfg, n)
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


def stage_activations(cfg: Config, plan: ParallelPlan, stage: int, chunk: int = 0, *,
                      device_type: str = "cuda") -> StageActivations:
    """Per micro-batch, for model chunk ``chunk`` of ``stage`` (the whole stage without interleaving)."""
    m, t = cfg.model, cfg.train
    tp, ep = plan.layout.tp, plan.layout.ep
    a = 2 if (t.bf16 or t.fp16) else 4
    autocast = a == 2
    b, s, h = t.micro_batch_size, m.seq_length, m.hidden_size
    n = b * s
    part = plan.stage(stage).chunks[chunk]
    first, last = part.first, part.last
    calls = {k: part.layer_keys.count(k) for k in dict.fromkeys(part.layer_keys)}
    per = {k: layer_activations(cfg, k, tp, ep, device_type=device_type) for k in calls}
    # Always kept: rope tables, the embedding's indices. Not the chunk's output: the schedule
    # frees it once sent (pipeline.schedules.deallocate_output); on the last stage it is the
    # final norm's saved input, counted in ``head``.
    common = 0
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
    specs = plan.tensors(stage)
    # A weight called several times in one forward gets one gradient buffer that autograd
    # accumulates into until its last use's backward: at the 16-bit cast autocast caches, or
    # in fp32 (the tied embedding: looked up in fp32, projected through its cast).
    shared = sum(s_.numel * (a if _cached_cast(s_) else 4) for s_ in specs
                 if s_.name.startswith("layers.") and calls.get(int(s_.name.split(".")[1]), 0) > 1)
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


def stage_schedule(cfg: Config, plan: ParallelPlan, stage: int) -> Tuple[Tuple[Op, ...], Tuple[int, ...]]:
    """The forwards and backwards a rank of ``stage`` runs in one step, and the p2p buffers its
    link holds during each (``pipeline.order``, ``pipeline.transfers``)."""
    layout = plan.layout
    schedule = cfg.parallel.pipeline_schedule if layout.pp > 1 else "1f1b"
    return _schedule(schedule, layout.pp, plan.num_model_chunks, num_microbatches(cfg, layout.world_size), stage)


@functools.lru_cache(maxsize=64)
def _schedule(schedule: str, pp: int, chunks: int, microbatches: int,
              stage: int) -> Tuple[Tuple[Op, ...], Tuple[int, ...]]:
    all_ops = [pipeline_ops(schedule, pp, chunks, microbatches, r) for r in range(pp)]
    return tuple(all_ops[stage]), tuple(link_buffers(all_ops, pp, chunks, stage))


def _chunk_memory(st: StageActivations, recompute: bool, offloaded: Sequence[int], n_h4: int) -> Tuple[int, int, int]:
    """(held, 16-bit weight copies) per micro-batch and the transient working set of one chunk."""
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
    return held, casts, max(fwd, st.head_bwd, bwd_layer)


def activation_memory(cfg: Config, plan: ParallelPlan, stage: int, *, recompute: Optional[bool] = None,
                      offloaded: Sequence[int] = (), device_type: str = "cuda") -> Dict[str, int]:
    """Peak activation bytes of a rank of ``stage``.

    ``activations``: what the micro-batches in flight keep for backward, at the point of the
    schedule where the most are (``pipeline.order``: with interleaving, (micro-batch, chunk)
    forwards, each weighted by its chunk), with the hidden-state buffers of sends not yet
    known received and of messages that arrived early (``pipeline.transfers.link_buffers``);
    ``compute_weights``: their 16-bit weight copies;
    ``in_flight``: the most forwards awaiting their backward (chunk forwards with
    interleaving); ``transient``: the largest working set on top, the worst over the chunks of
    (a) the forward of the loss (logits, their fp32 copy) and, under recomputation, the
    autocast cache of the chunk's weights plus one layer's no-grad forward; (b) the backward
    of the loss (logit gradients); (c) the backward of the largest layer: recomputed in full
    when recomputing, plus its widest activation gradient, its largest weight gradient and
    the gradient buffers of weights called more than once (pseudo slots, tied embedding).
    Offloaded modules (``megatron_p2r.offload``) always run recomputed with fetched weights.
    """
    recompute = cfg.train.recompute_activations if recompute is None else recompute
    n_h4 = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size * 4
    chunks = [_chunk_memory(stage_activations(cfg, plan, stage, c, device_type=device_type), recompute, offloaded,
                            n_h4) for c in range(plan.num_model_chunks)]
    ops, buffers = stage_schedule(cfg, plan, stage)
    return {"held_per_microbatch": sum(held + casts for held, casts, _ in chunks),
            "in_flight": int(max_outstanding(ops)),
            "activations": int(max_outstanding(ops, lambda c: chunks[c][0], [n_h4 * b for b in buffers])),
            "compute_weights": int(max_outstanding(ops, lambda c: chunks[c][1])),
            "transient": max(transient for _, _, transient in chunks)}
