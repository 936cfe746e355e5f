"""Activation memory: what autograd keeps per micro-batch, counted op by op from this code.

Activations held per in-flight micro-batch — with sequence parallelism (the regions outside
the TP matmuls hold 1/TP of the tokens), selective recomputation (the attention core) or full
recomputation (units of layers of each model chunk, ``TrainConfig.recompute_units``) — at the
point of the schedule (``pipeline.order``) where the most are in flight, plus the largest
transient working set. Everything computes in the weights' dtype (fp32, or 16-bit with
--bf16/--fp16: the model holds 16-bit weights and fp32 main gradients, no autocast, so there
are no weight copies to count). Sizes are in bytes for CUDA kernels (bool dropout masks, fused
attention without s x s tensors); ``device_type="cpu"`` gives the CPU variant the tests
measure against. See docs/scale.md for the assumptions and for the comparison with
Korthikanti et al. 2022 (``korthikanti_layer_bytes``).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from megatron_p2r.config import Config, num_microbatches
from megatron_p2r.config.schedule import COMBINED
from megatron_p2r.layout.plan import ParallelPlan, StagePlan
from megatron_p2r.parallel.cross_entropy import chunk_tokens
from megatron_p2r.pipeline.order import Op, combined_ops, max_outstanding, pipeline_ops
from megatron_p2r.pipeline.transfers import every_link_buffers


@dataclass
class LayerActivations:
    held: int  # bytes autograd keeps for backward
    work: int  # activation gradients alive at once in the MLP's backward
    backward: int = 0  # the MLP backward's peak on top of ``held`` (gradients minus what it freed)


def compute_bytes(cfg: Config) -> int:
    """Bytes of an activation element: the weights' dtype."""
    return 2 if (cfg.train.bf16 or cfg.train.fp16) else 4


def moe_rows(cfg: Config, tokens: int) -> Tuple[int, int]:
    """(slots per token, kept assignments) for ``tokens`` tokens, with balanced routing. The
    experts compute and keep exactly these rows with --moe-grouped-gemm, and dropless whatever
    the routing; the padded experts (the default) pad every local expert to the fullest one's
    count, which balanced routing does not have and imbalanced routing adds on top."""
    m = cfg.model
    slots = m.moe_slots
    rows = tokens * slots
    capacity = m.expert_capacity(tokens)
    if capacity is not None:
        rows = min(rows, capacity * m.num_experts)
    return slots, rows


def expert_rows(cfg: Config, tokens: int) -> int:
    """Rows the experts compute and the all-to-alls move: the kept assignments, or with
    --moe-pad-expert-input-to-capacity every expert's padded count (the same under balanced
    routing when the capacity is full, more when it is not)."""
    per_expert = cfg.model.padded_expert_rows(tokens)
    return moe_rows(cfg, tokens)[1] if per_expert is None else per_expert * cfg.model.num_experts


def math_attention(cfg: Config, device_type: str) -> bool:
    """Whether the attention kernel that will run keeps the s x s probabilities. The model calls
    torch's SDPA with ``is_causal`` and no mask; CUDA's flash and memory-efficient kernels keep
    only a log-sum-exp (dropout replays its RNG), and so does the CPU flash kernel, which torch
    picks only without dropout: with --attention-dropout in training CPU runs the math kernel,
    which keeps the probabilities, the dropout mask and the dropped probabilities in fp32 (also
    for 16-bit inputs) and fp32 copies of q, k and v. Soft-capped attention never calls SDPA
    (``softcapped_core_bytes``)."""
    m = cfg.model
    return device_type != "cuda" and m.attention_dropout > 0 and m.attn_logit_softcapping is None


def latent_math_attention(cfg: Config, device_type: str) -> bool:
    """Whether multi-latent attention's SDPA call runs the math kernel: on CPU with dropout, as
    ``math_attention``, and also whenever the value heads are narrower or wider than the query/key
    heads (CPU's flash kernel needs one head dimension; CUDA's memory-efficient kernel does not)."""
    m = cfg.model
    return device_type != "cuda" and (m.attention_dropout > 0 or m.v_head_dim != m.q_head_dim)


def _latent_attention_held(cfg: Config, n: int, ns: int, tp: int, a: int, device_type: str) -> int:
    """What model/latent_attention.py saves: the input of the down-projections (one tensor, this
    rank's sequence shard under sequence parallelism), the latents the up-projections read (the
    key/value one a view of the down-projection's output beside the rotary key) and their norms,
    the output projection's input; the kernel's q, k (concatenated from the non-rotary and rotated
    parts) and v (a view of the key/value up-projection's output), its output and log-sum-exp;
    or, with the math kernel (``latent_math_attention``), its fp32 copies of q, k, v and the
    probabilities (with dropout also the mask and the dropped probabilities)."""
    m, t = cfg.model, cfg.train
    heads, rotary = m.num_attention_heads // tp, m.qk_pos_emb_head_dim
    q, v, kv_up = (n * heads * d for d in (m.q_head_dim, m.v_head_dim, m.qk_head_dim + m.v_head_dim))
    held = ns * m.hidden_size * a + v * a
    if m.q_lora_rank is not None:
        held += ns * m.q_lora_rank * a + (norm_held(m, ns, m.q_lora_rank, a) if m.qk_layernorm else 0)
    if m.qk_layernorm:  # the norm's input is a view: it keeps the rotary key beside it, unless upcast
        whole = m.normalization == "LayerNorm" or a == 4
        held += ns * m.kv_lora_rank * a + norm_held(m, ns, m.kv_lora_rank, a) + (ns * rotary * a if whole else 0)
    else:
        held += ns * (m.kv_lora_rank + rotary) * a
    selective = t.recompute == "selective"  # the recompute checkpoint saves q, k, v as a fused kernel would
    rows = t.micro_batch_size * heads * m.seq_length
    if selective or not latent_math_attention(cfg, device_type):
        return held + (2 * q + kv_up) * a + (0 if selective else v * a + rows * 4)
    probabilities = 3 if m.attention_dropout > 0 else 1
    return held + (2 * q + v) * 4 + probabilities * rows * m.seq_length * 4


def _attention_held(cfg: Config, n: int, ns: int, tp: int, a: int, device_type: str = "cuda") -> int:
    """What attention saves: the projections' input (this rank's sequence shard under sequence
    parallelism; one tensor shared by the query and key/value projections), q and the key/value
    heads this rank holds (one replica when TP > groups), the q/k norms', the rotated q and k,
    the output and, unless selective recomputation recomputes the core, its log-sum-exp; or, with
    the math kernel (``math_attention``), what it keeps instead of q, k, v and the log-sum-exp."""
    m = cfg.model
    if m.multi_latent_attention:
        return _latent_attention_held(cfg, n, ns, tp, a, device_type)
    heads, d = m.num_attention_heads // tp, m.head_dim
    q, kv = n * heads * d, n * max(m.query_groups // tp, 1) * d
    selective = cfg.train.recompute == "selective"  # the recompute checkpoint saves q, k, v as a kernel would
    unfused = math_attention(cfg, device_type) and not selective
    norm_keeps_input = m.qk_norm is not None and not (m.qk_norm != "LayerNorm" and a != 4)
    # the projections' outputs: all of q, k, v when fused (v keeps the QKV tensor alive); a
    # separate query's only while an op saves it: the q norm (not a 16-bit RMSNorm, which saves
    # its fp32 upcast), or attention itself when neither the norm nor rotary replaces it; the math
    # kernel copies what it saves, so only a norm's input keeps them
    if unfused:
        if norm_keeps_input:
            projected = q + 2 * kv
        elif _math_value_is_view(cfg, tp, a):  # v's tensor: the fused QKV, or the separate key/value
            projected = 2 * kv if m.group_query_attention else q + 2 * kv
        else:
            projected = 0
    elif m.qk_norm:
        projected = q + 2 * kv if norm_keeps_input or not m.group_query_attention else 2 * kv
    else:
        query_saved = m.position_embedding_type != "rope"
        projected = q + 2 * kv if query_saved or not m.group_query_attention else 2 * kv
    held = ns * m.hidden_size * a + projected * a + q * a
    if cfg.parallel.context_parallel_size > 1:
        held += context_core_bytes(cfg, q, kv, projected, selective, a)
    if not selective:
        held += attention_core_bytes(cfg, tp, device_type)
        held += softcapped_core_bytes(cfg, q, a)
        if m.softmax_type != "vanilla":  # k and v with the sink slot, the float mask (CUDA's kernel keeps them)
            held += (2 * (kv + kv // m.seq_length) + heads * m.seq_length * (m.seq_length + 1)) * a
    if m.qk_norm:
        held += _qk_norm_held(m, q, kv, d, a, kernel_saves_outputs=not unfused, tokens=n)
    if m.position_embedding_type == "rope" and not unfused:
        held += (q + kv) * a  # rotated q and k
    return held


def local_sequence(cfg: Config) -> Config:
    """``cfg`` as one CP rank sees it: every module runs on its s/CP tokens (its two chunks),
    the attention core's extra bytes are ``context_core_bytes``."""
    cp = cfg.parallel.context_parallel_size
    return cfg if cp == 1 else cfg.replace(seq_length=cfg.model.seq_length // cp)


def context_core_bytes(cfg: Config, q: int, kv: int, projected: int, selective: bool, a: int) -> int:
    """What context_parallel_attention (``megatron_p2r.context``) keeps beyond the one-process
    kernel on the rank's ``q`` query and ``kv`` key (= value) elements, counted from its ops
    (measured on CP2, tests/planning/test_context_parallel.py). Under selective recomputation
    nothing: the checkpoint keeps only q, k, v. Otherwise every comm type saves its output
    contiguous as [b, heads, s, d] (a fused kernel's is [b, s, heads, d]), so the output
    projection's input is one more copy (``q``); p2p saves its inputs, merged output and
    log-sum-exp as the kernel does; allgather saves the gathered K/V of the whole sequence
    (2·kv·CP), its two chunks' [chunk, keys] float masks (2CP+1 squares of a chunk; fewer under
    a sliding window: an upper bound) and the int64 order of the sequence instead of the local
    K/V; a2a saves the all-to-all's q, k, v (q + 2·kv) and two int64 orders instead of the local
    q, k, v."""
    m, cp, comm = cfg.model, cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type
    if selective:
        return 0
    held = q * a
    if comm == "p2p":
        return held
    rope = m.position_embedding_type == "rope"
    # the local tensors held only because the kernel saved them: the rotated q, k (rope) and the
    # projection outputs q, k, v are views of (``projected``) once nothing else keeps them; with
    # --qk-layernorm the norms keep their own (not subtracted: an upper bound)
    if m.qk_norm:
        freed_kv = freed_qkv = 0
    elif rope:
        freed_kv, freed_qkv = kv + projected, q + kv + projected
    else:  # allgather still saves q: a fused QKV output stays, a separate query's projection too
        freed_kv, freed_qkv = (projected - q if m.group_query_attention else 0), projected
    if comm == "allgather":
        chunk = m.seq_length // 2
        return held + (2 * kv * cp + (2 * cp + 1) * chunk * chunk - freed_kv) * a + 8 * m.seq_length * cp
    return held + (q + 2 * kv - freed_qkv) * a + 2 * 8 * m.seq_length * cp


def _qk_norm_held(m, q: int, kv: int, d: int, a: int, kernel_saves_outputs: bool = True, tokens: int = 0) -> int:
    """--qk-layernorm or --qk-l2-norm over q (``q`` elements) and the local keys (``kv``): each norm
    keeps its statistics (LayerNorm mean and rstd, RMSNorm rstd and x * rstd in fp32, the L2 norm
    rstd, and with 16-bit weights their fp32 copy of the input) and, when a fused kernel saves it and rotary does not
    replace it, its output; that output is contiguous per head, so the fused kernel's output
    (saved) needs a copy for the output projection. Statistics are per head, or per token
    (``tokens``) with --qk-layernorm-over-heads."""
    held = q * a if kernel_saves_outputs else 0  # the kernel's output beside the copy
    for elements in (q, kv):
        rows = tokens if m.qk_layernorm_over_heads else elements // d
        if m.qk_norm == "LayerNorm":
            held += 2 * rows * 4
        else:  # RMSNorm's x * rstd is kept for its weight's gradient; the L2 norm has no weight
            held += rows * 4 + (elements * 4 if m.qk_norm == "RMSNorm" else 0) + (elements * 4 if a != 4 else 0)
        if m.position_embedding_type != "rope" and kernel_saves_outputs:
            held += elements * a
    return held


def norm_held(m, rows: int, width: int, a: int) -> int:
    """What one norm over [rows, width] in ``a``-byte elements keeps for backward: LayerNorm its
    input and fp32 mean and rstd; torch's RMSNorm its input upcast to fp32 (the input itself
    when fp32), the fp32 rstd and x * rstd (measured, tests/planning/test_planner.py)."""
    if m.normalization == "LayerNorm":
        return rows * width * a + rows * 8
    return 2 * rows * width * 4 + rows * 4


def unsaved_norm_input(m, a: int) -> int:
    """1 when a norm's input is not among what it keeps for backward (``norm_held``): RMSNorm
    over 16-bit input keeps its fp32 upcast instead; else 0."""
    return int(m.normalization != "LayerNorm" and a != 4)


def attention_core_bytes(cfg: Config, tp: int, device_type: str = "cuda") -> int:
    """What the attention core keeps besides its inputs and output: a fused kernel its
    log-sum-exp (what selective recomputation saves with fused kernels); the math kernel
    (``math_attention``) fp32 copies of q, k, v (key/value heads repeated to the query heads)
    and three fp32 [b, heads, s, s] tensors: the probabilities, the dropout mask, the dropped
    probabilities."""
    m, t = cfg.model, cfg.train
    rows = t.micro_batch_size * (m.num_attention_heads // tp) * m.seq_length
    if math_attention(cfg, device_type):
        copies = 2 if _math_value_is_view(cfg, tp, compute_bytes(cfg)) else 3
        return copies * rows * m.head_dim * 4 + 3 * rows * m.seq_length * 4
    return rows * 4


def softcapped_core_bytes(cfg: Config, q: int, a: int) -> int:
    """What soft-capped attention (--attn-logit-softcapping: ``model.attention.softcapped_attention``,
    the math block kernel of ``context.kernels``) keeps beyond a fused kernel, which it otherwise
    matches (q, k, v, the output, the fp32 log-sum-exp): its output is contiguous [b, heads, s, d],
    so the output projection's input is a copy (``q`` elements; with q/k norms a fused kernel's
    output is contiguous too, and ``_qk_norm_held`` counts the copy); in training with
    --attention-dropout its bool keep mask [b, heads, s, s]."""
    m = cfg.model
    if m.attn_logit_softcapping is None:
        return 0
    keep = q // m.head_dim * m.seq_length if m.attention_dropout > 0 else 0
    return (0 if m.qk_norm else q * a) + keep


def _softcapped_backward(cfg: Config, tp: int) -> int:
    """Soft-capped attention's backward on top of what the layer holds: the recomputed fp32 scores
    [b, heads, s, s] and their tanh, the probabilities, their gradient and the score gradient, each
    with a temporary, and the fp32 gradients of q, k, v; under selective recomputation also the
    core it first recomputes (its output and log-sum-exp)."""
    m, t = cfg.model, cfg.train
    rows = t.micro_batch_size * (m.num_attention_heads // tp) * m.seq_length
    extra = 6 * rows * m.seq_length * 4 + 3 * rows * m.head_dim * 4
    if t.recompute == "selective":
        extra += rows * m.head_dim * compute_bytes(cfg) + attention_core_bytes(cfg, tp)
    return extra


def _math_attention_backward(cfg: Config, tp: int, device_type: str) -> int:
    """The math kernel's backward on top of what the layer holds: one [b, heads, s, s] gradient
    beside the saved three and the fp32 gradients of q, k, v; under selective recomputation
    also the core it first recomputes. The layer's MLP half is freed by then (the caller
    subtracts it)."""
    m, t = cfg.model, cfg.train
    rows = t.micro_batch_size * (m.num_attention_heads // tp) * m.seq_length
    extra = rows * m.seq_length * 4 + 3 * rows * m.head_dim * 4
    if t.recompute == "selective":
        extra += attention_core_bytes(cfg, tp, device_type)
    return extra


def _math_value_is_view(cfg: Config, tp: int, a: int) -> bool:
    """Whether the math kernel saves v as a view of the projection's output instead of a copy:
    fp32 (no upcast), no key/value heads repeated to the query heads, and one sample per
    micro-batch (torch's matmul can fold [1, heads] of the strided v without copying)."""
    m = cfg.model
    local_groups = max(m.query_groups // tp, 1)
    return a == 4 and local_groups == m.num_attention_heads // tp and cfg.train.micro_batch_size == 1


def _grouped_swiglu(m) -> bool:
    """Whether grouped experts run as ``moe.grouped_swiglu`` (SiLU-gated, no clamp, offset or
    biases: ``Activation.is_swiglu``), which keeps weight1 itself rather than its reordered copy."""
    return m.swiglu and m.activation_func_clamp_value is None and not m.glu_linear_offset and not m.add_bias


def _shared_experts_held(m, ns: int, n: int, tp: int, a: int) -> int:
    """What a MoE layer's shared experts (model/mlp.py ``SharedExperts``) save: a dense MLP's fc1
    output and activation tensors on the ``n`` tokens of the TP region; their input is the
    router's (in 16-bit the router keeps an fp32 copy, so the 16-bit input is held too); the gate
    keeps the MLP's output and its sigmoid, on the ``ns`` tokens of this rank."""
    f = m.shared_expert_ffn_size // tp
    if not f:
        return 0
    glu = 2 if m.gated_linear_unit else 1
    held = n * glu * f * a + n * activation_saved(m) * f * a + (ns * m.hidden_size * a if a != 4 else 0)
    if m.moe_shared_expert_gate:
        held += ns * m.hidden_size * a + ns * a
    return held


def _moe_layer(cfg: Config, ns: int, n: int, tp: int, ep: int, a: int) -> Tuple[int, int, int]:
    """(held, work, backward) of the MoE MLP: the router on the ``ns`` tokens of
    this rank (a sequence shard under sequence parallelism), experts on the ``n`` tokens of the
    TP region."""
    m = cfg.model
    (slots, kept), rows = moe_rows(cfg, n), expert_rows(cfg, n)
    glu = 2 if m.gated_linear_unit else 1
    act_saved = activation_saved(m)
    f, e_local = m.expert_ffn_size // tp, m.num_experts // ep
    held = ns * m.hidden_size * 4 + ns * m.num_experts * 4 + ns * slots * 8  # fp32 router input, probs, top-k ids
    sigmoid = m.moe_router_score_function == "sigmoid"
    if (sigmoid and m.moe_router_topk > 1) or (
        not sigmoid and m.moe_num_prototypes == 1 and not m.moe_router_pre_softmax
    ):
        held += ns * slots * 4 + ns * 4  # the weights normalised over the chosen k: the chosen and their sum
    if a != 4:  # the router's weight cast to fp32
        held += m.num_experts * m.hidden_size * 4
    if m.moe_z_loss_coeff:  # logsumexp's input (the logits) and output
        held += ns * m.num_experts * 4 + ns * m.moe_num_prototypes * 4
    held += kept * 8 + rows * 8 * ((ep > 1) + m.add_bias)  # order, [EP permutation], [expert ids for biases]
    if m.moe_pad_expert_input_to_capacity:
        held += kept * 8  # the padded rows' places of the kept ones
    held += rows * m.hidden_size * a  # expert input rows
    held += rows * glu * f * a + rows * act_saved * f * a  # fc1 out, activation outputs
    if m.moe_grouped_gemm and m.gated_linear_unit and not _grouped_swiglu(m):  # weight1 as [gates; ups], a copy
        held += e_local * glu * f * m.hidden_size * a
    # the combine (dispatcher.weighted_unpermute) keeps every slot's row of the n tokens (a dropped
    # slot's is zeros) in the rows' dtype and the fp32 [slots, n] weights, not the expert output
    combine = slots * n * m.hidden_size * a + slots * n * 4
    held += combine + _shared_experts_held(m, ns, n, tp, a)
    work = rows * f * a * glu
    # at the expert matmuls' backward the combine side is freed; both stacked weight
    # gradients are alive (autograd accumulates them after the expert block)
    backward = work + e_local * (glu + 1) * f * m.hidden_size * a - combine
    return held, work, backward


def cut_moe_layer_kept(cfg: Config, ns: int, n: int) -> int:
    """What a MoE layer recomputed node by node keeps beyond its input, in the overlapped expert
    schedule (--overlap-moe-expert-parallel-comm with full recomputation: pipeline/a2a_overlap.py):
    the inputs of its later nodes, kept so that its backward re-communicates nothing -- the
    residual stream after attention (``ns`` tokens), the routing (the rows' order, the fp32
    combine weights of the ``n`` tokens), the received rows' permutation to expert order -- and
    both all-to-alls' results (the rows it sent are freed once received). Balanced routing: a
    rank receives as many rows as it sends."""
    m = cfg.model
    (slots, kept), rows = moe_rows(cfg, n), expert_rows(cfg, n)
    return (
        ns * m.hidden_size * compute_bytes(cfg)
        + kept * 8
        + rows * 8
        + (kept * 8 if m.moe_pad_expert_input_to_capacity else 0)
        + slots * n * 4
        + 2 * rows * m.hidden_size * compute_bytes(cfg)
    )


def sinks_unmodelled(m, device_type: str) -> bool:
    """Whether this estimate cannot model the attention: the float mask of --softmax-type
    off-by-one/learnable (model/attention.py) makes SDPA run its math kernel on CPU, whose
    tensors with the sink slot are not counted here (the CUDA estimate is a lower bound)."""
    return device_type != "cuda" and m.softmax_type != "vanilla"


def activation_saved(m) -> int:
    """Tensors of fc2's width the activation (model/mlp.py ``Activation``) saves besides fc1's
    output: GELU its output; SwiGLU SiLU's output and the product; quick-GeGLU the sigmoid, the
    gate's quick-GELU and the product; a clamp the clamped gate and, as an offset does, a new
    linear half in place of a view of fc1's output."""
    if not m.gated_linear_unit:
        return 1
    saved = 3 if m.quick_geglu else 2
    clamped = m.activation_func_clamp_value is not None
    return saved + clamped + (clamped or m.glu_linear_offset != 0.0)


def token_bytes(cfg: Config) -> int:
    """Bytes of one token of the residual stream (the weights' dtype)."""
    return cfg.model.hidden_size * compute_bytes(cfg)


def layer_activations(
    cfg: Config, key: int, tp: int, ep: int, *, device_type: str = "cuda", sequence_parallel: bool = False
) -> LayerActivations:
    """What one transformer layer (module ``key``) saves for backward, per micro-batch.

    Counted from the ops of model/block.py: everything computes in the weights' dtype (``a``:
    fp32, or 16-bit with --bf16/--fp16), norms keep their input and fp32 statistics, each
    linear saves its input — the sequence shard under sequence parallelism, gathered again in
    backward; attention saves q, k, v (views of the QKV output, or the rotated q, k), its output
    and log-sum-exp (not under selective recomputation).
    """
    m, t = cfg.model, cfg.train
    a = compute_bytes(cfg)
    n, h = t.micro_batch_size * m.seq_length, m.hidden_size
    ns = n // tp if sequence_parallel else n  # tokens outside the TP regions
    norms = 2 * (m.input_norms + m.output_norms)  # --layer-norms: on the branches' inputs, outputs or both
    held = norms * norm_held(m, ns, h, a) + _attention_held(cfg, n, ns, tp, a, device_type)
    if sinks_unmodelled(m, device_type):
        raise ValueError(
            "softmax offsets (--softmax-type) on CPU run the math attention kernel with a float mask, "
            "which the planner does not model; plan with device_type='cuda'"
        )
    if m.hidden_dropout:
        held += 2 * ns * h * (1 if device_type == "cuda" else a)
    glu = 2 if m.gated_linear_unit else 1
    act_saved = activation_saved(m)
    if m.is_moe_layer(key):
        mlp_held, work, backward = _moe_layer(cfg, ns, n, tp, ep, a)
        held += mlp_held
    else:
        f = m.ffn_size // tp
        mlp_held = ns * h * a + n * glu * f * a + n * act_saved * f * a
        held += mlp_held
        work = n * f * a * glu
        backward = work + h * f * a  # fc2's weight gradient
        if sequence_parallel:  # fc1's backward: its input gathered again, the input's gradient
            backward = max(backward, work + 2 * n * h * a)
    if math_attention(cfg, device_type) and not m.multi_latent_attention:
        backward = max(backward, _math_attention_backward(cfg, tp, device_type) - mlp_held - norm_held(m, ns, h, a))
    if m.attn_logit_softcapping is not None:
        backward = max(backward, _softcapped_backward(cfg, tp) - mlp_held - norm_held(m, ns, h, a))
    return LayerActivations(held=held, work=work, backward=backward)


@dataclass
class StageActivations:
    """Per micro-batch, for one model chunk of a pipeline stage (the whole stage without interleaving)."""

    held: int  # no recomputation: everything autograd saves
    head: int  # of which the final norm, output layer and loss (last stage)
    layers: Dict[int, LayerActivations] = field(default_factory=dict)  # per module key, per call
    head_fwd: int = 0  # the loss's forward: a chunk of logits and its gradients
    head_bwd: int = 0  # the loss's backward: a chunk of logit gradients, input and weight gradients
    shared_grads: int = 0  # gradient buffers of weights used several times in one forward


def _embedding_bytes(cfg: Config, tp: int, ns: int, device_type: str) -> int:
    """What the first stage's embedding keeps: position ids, TP masks, the dropout mask."""
    m, s = cfg.model, cfg.model.seq_length
    out = 0
    if m.position_embedding_type == "learned_absolute":
        out += ns // cfg.train.micro_batch_size * 8
    if tp > 1:
        out += cfg.train.micro_batch_size * s * 9  # masked local ids (int64) + mask
    if m.hidden_dropout:
        out += ns * m.hidden_size * (1 if device_type == "cuda" else compute_bytes(cfg))
    return out


def _head(cfg: Config, tp: int, ns: int, sequence_parallel: bool) -> Tuple[int, int, int]:
    """(held, forward transient, backward transient) of the final norm and the fused output
    layer + loss as the schedules run it (``parallel/cross_entropy.py`` with the loss mask): the
    loss's forward computes its gradients, so it keeps the input's (``n' x h``, fp32) and the
    output weight's (``V/t x h``, fp32) -- no input, no logits -- and works one chunk of tokens'
    logits at a time."""
    m = cfg.model
    a = compute_bytes(cfg)
    h, n = m.hidden_size, cfg.train.micro_batch_size * m.seq_length
    v = m.padded_vocab_size // tp
    chunk = min(n, chunk_tokens(v))
    held = norm_held(m, ns, h, a) + ns * h * 4 + v * h * 4
    gathered = n * h * a if sequence_parallel else 0
    # the gathered input (SP), a chunk's fp32 logits (and their 16-bit matmul output / gradient),
    # one chunk's weight gradient before it is added, the full input gradient before its
    # reduce-scatter (SP); and while the loss runs the model's forward still holds the final
    # norm's output (the loss's input) and its input, the last layer's output (saved by the norm
    # when it keeps its input), freed when the forward returns
    fwd = gathered + chunk * v * (4 + (a if a != 4 else 0)) + v * h * a + (n - ns) * h * 4 + n * 16
    fwd += (1 + unsaved_norm_input(m, a)) * ns * h * a
    return held, fwd, ns * h * 4 + v * h * 4


def _mtp_depth(cfg: Config, tp: int, ep: int, ns: int, sequence_parallel: bool, device_type: str) -> LayerActivations:
    """What one multi-token prediction depth (model/mtp.py) saves besides its loss (which saves
    what the main loss does, ``_head``): the shifted ids and what the embedding keeps of their
    lookup, the two input norms and the concatenation the 2h -> h projection saves (the sequence
    shard under sequence parallelism), a layer of the last layer's kind, its final norm."""
    m = cfg.model
    a, h, b = compute_bytes(cfg), m.hidden_size, cfg.train.micro_batch_size
    layer = layer_activations(
        cfg, m.num_layers - 1, tp, ep, device_type=device_type, sequence_parallel=sequence_parallel
    )
    lookup = b * m.seq_length * 8 + _embedding_bytes(cfg, tp, ns, device_type)  # the shifted ids, as the embedding's
    held = lookup + 3 * norm_held(m, ns, h, a) + ns * 2 * h * a + layer.held
    return LayerActivations(held=held, work=layer.work, backward=layer.backward)


def rope_table_bytes(m) -> int:
    """The fp32 cos and sin tables of rotary positions (latent attention's YaRN tables, whatever
    --position-embedding-type), made once per forward."""
    if m.multi_latent_attention:
        return 2 * m.seq_length * m.qk_pos_emb_head_dim * 4
    if m.position_embedding_type == "rope":
        return 2 * m.seq_length * m.head_dim * 4
    return 0


def stage_activations(
    cfg: Config, plan: ParallelPlan, stage: int, chunk: int = 0, *, device_type: str = "cuda"
) -> StageActivations:
    """Per micro-batch, for model chunk ``chunk`` of ``stage`` (the whole stage without interleaving)."""
    m, t = cfg.model, cfg.train
    tp, ep, sp = plan.layout.tp, plan.layout.ep, plan.sequence_parallel
    a = compute_bytes(cfg)
    n = t.micro_batch_size * m.seq_length
    ns = n // tp if sp else n
    part = plan.stage(stage).chunks[chunk]
    calls = Counter(part.layer_keys)
    per = {k: layer_activations(cfg, k, tp, ep, device_type=device_type, sequence_parallel=sp) for k in calls}
    # Always kept: rope tables, the embedding's indices. Not the chunk's output: the schedule
    # frees it once sent (pipeline.p2p.deallocate_output); on the last stage it is the
    # final norm's saved input, counted in ``head``.
    common = rope_table_bytes(m)
    if part.first:
        common += _embedding_bytes(cfg, tp, ns, device_type)
    head = head_fwd = head_bwd = 0
    if part.last:
        head, head_fwd, head_bwd = _head(cfg, tp, ns, sp)
        if m.mtp_num_layers:  # each depth: its layers (``_mtp_depth``) and a loss as the main one
            depth = _mtp_depth(cfg, tp, ep, ns, sp, device_type)
            head += m.mtp_num_layers * (depth.held + head - norm_held(m, ns, m.hidden_size, a))
            head_bwd = max(head_bwd, depth.backward + ns * m.hidden_size * a)
            # a depth's loss runs while the main loss's input (the depths' input: saved by their
            # norm when it keeps its input) is still held, beside the depths' shifted labels
            # (int64), mask (fp32) and positions (int64) and the rope tables ``_head`` makes for them
            b, s = t.micro_batch_size, m.seq_length
            head_fwd += unsaved_norm_input(m, a) * ns * m.hidden_size * a + b * s * 12 + s * 8 + rope_table_bytes(m)
    # A weight called several times in one forward gets one gradient buffer (its dtype) that
    # autograd accumulates into until its last use's backward (the tied embedding too).
    shared = sum(s_.numel * a for s_ in plan.tensors(stage) if s_.module_key is not None and calls[s_.module_key] > 1)
    if part.first and part.last and not m.untie_embeddings_and_output_weights:
        shared += a * (m.padded_vocab_size // tp) * m.hidden_size
    return StageActivations(
        held=common + head + sum(per[k].held * c for k, c in calls.items()),
        head=head,
        layers=per,
        head_fwd=head_fwd,
        head_bwd=head_bwd,
        shared_grads=shared,
    )


def with_recompute(cfg: Config, granularity: Optional[str]) -> Config:
    """``cfg`` without recomputation (None), with selective, or with every layer recomputed."""
    full = granularity == "full"
    return cfg.replace(
        recompute_activations=False,
        recompute_granularity=granularity,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
    )


def recomputed_positions(cfg: Config, stage: StagePlan, offloaded: Sequence[int] = ()) -> set:
    """Positions (in ``stage.layer_keys``) of the layers that run their forward twice: in a
    recomputed unit of their model chunk, or offloaded (they recompute themselves)."""
    out, start = set(), 0
    for part in stage.chunks:
        out |= {start + p for p in _units(cfg, part.layer_keys, offloaded)[2]}
        start += len(part.layer_keys)
    return out


def cut_positions(cfg: Config, stage: StagePlan, offloaded: Sequence[int] = ()) -> set:
    """Positions of the layers the overlapped expert schedule recomputes node by node (full
    recomputation with --overlap-moe-expert-parallel-comm): they keep their all-to-alls' results
    rather than communicating them again. Offloaded layers recompute themselves whole."""
    if not cfg.parallel.overlap_moe_expert_parallel_comm:
        return set()
    return {p for p in recomputed_positions(cfg, stage, offloaded) if stage.layer_keys[p] not in set(offloaded)}


def _units(cfg: Config, keys: Sequence[int], offloaded: Sequence[int]):
    """A model chunk's recompute units (positions), offloaded layers standing alone (they
    recompute themselves), and the set of positions that keep only their input."""
    standalone = [p for p, key in enumerate(keys) if key in set(offloaded)]
    units = cfg.train.recompute_units(len(keys), standalone)
    light = {p for unit, recomputed in units if recomputed for p in unit} | set(standalone)
    return units, set(standalone), light


def _backward_peak(st: StageActivations, keys: Sequence[int], units, standalone: set, hidden_bytes: int) -> int:
    """The largest working set of one layer's backward: a recomputed unit re-creates all its
    layers' activations and frees them from the last layer down; a layer that was not
    recomputed has its output's gradient (``hidden_bytes``) on top."""
    peak = 0
    for unit, recomputed in units:
        alive = 0
        for p in unit:
            layer = st.layers[keys[p]]
            if recomputed or p in standalone:
                alive += layer.held
                peak = max(peak, alive + layer.backward)
            else:
                peak = max(peak, layer.backward + hidden_bytes)
    return peak - st.head + st.shared_grads


def _embedding_backward(cfg: Config, plan: ParallelPlan, stage: int) -> int:
    """The word embedding's dense gradient at the end of the first stage's backward; tied on a
    single stage, autograd then adds it to the output layer's (held until then): three
    vocabulary-sized tensors at once."""
    st = plan.stage(stage)
    if not st.first:
        return 0
    table = cfg.model.padded_vocab_size // plan.layout.tp * cfg.model.hidden_size * compute_bytes(cfg)
    return table * (3 if st.last and not cfg.model.untie_embeddings_and_output_weights else 1)


def _chunk_memory(
    cfg: Config,
    plan: ParallelPlan,
    stage: int,
    chunk: int,
    offloaded: Sequence[int],
    hidden_bytes: int,
    device_type: str,
) -> Tuple[int, int]:
    """(held per micro-batch, the transient working set) of one model chunk."""
    st = stage_activations(cfg, plan, stage, chunk, device_type=device_type)
    keys = plan.stage(stage).chunks[chunk].layer_keys
    units, standalone, light = _units(cfg, keys, offloaded)
    kept_inputs = sum(1 for unit, recomputed in units if recomputed) + len(standalone)
    held = st.held - sum(st.layers[keys[p]].held for p in light) + kept_inputs * hidden_bytes
    if not plan.stage(stage).chunks[chunk].first and 0 not in light:
        # the received input stays until its backward (the schedule reads its gradient), its
        # storage counted above only when the first norm keeps it (not RMSNorm over 16-bit)
        held += unsaved_norm_input(cfg.model, compute_bytes(cfg)) * hidden_bytes
    if cfg.parallel.overlap_moe_expert_parallel_comm:  # MoE layers cut at their all-to-alls
        ns, n = hidden_bytes // token_bytes(cfg), cfg.train.micro_batch_size * cfg.model.seq_length
        moe = {p for p in range(len(keys)) if cfg.model.is_moe_layer(keys[p])}
        # recomputed node by node; one not recomputed holds what the serial layer holds
        held += cut_moe_layer_kept(cfg, ns, n) * len(moe & (light - standalone))
    fwd = st.head_fwd
    if light:  # a recomputed layer's no-grad forward
        fwd = max(fwd, 2 * max(st.layers[keys[p]].work for p in light))
    embedding = _embedding_backward(cfg, plan, stage) if plan.stage(stage).chunks[chunk].first else 0
    return held, max(fwd, st.head_bwd, _backward_peak(st, keys, units, standalone, hidden_bytes), embedding - held)


def stage_schedule(cfg: Config, plan: ParallelPlan, stage: int) -> Tuple[Tuple[Op, ...], Tuple[int, ...]]:
    """The forwards and backwards a rank of ``stage`` runs in one step, and the p2p buffers its
    link holds during each (``pipeline.order``, ``pipeline.transfers``), for the schedule the
    config chose (``plan.schedule``). Under --overlap-moe-expert-parallel-comm the combined 1F1B
    steps (a forward and a backward in flight together: ``order.combined_ops``)."""
    s = plan.schedule
    return _schedules(
        s.kind, s.order, s.stages, s.chunks, num_microbatches(cfg, plan.layout.world_size), s.posts_receives_ahead
    )[stage]


@functools.lru_cache(maxsize=8)
def _schedules(
    kind: str, order: str, pp: int, chunks: int, microbatches: int, posted_ahead: bool
) -> Tuple[Tuple[Tuple[Op, ...], Tuple[int, ...]], ...]:
    """Every stage's ops and link buffers, computed together (each stage's depends on all)."""
    if kind == COMBINED:
        all_ops = [combined_ops(pp, chunks, microbatches, r) for r in range(pp)]
    else:
        all_ops = [pipeline_ops(order, pp, chunks, microbatches, r) for r in range(pp)]
    buffers = every_link_buffers(all_ops, pp, chunks, posted_ahead)
    return tuple((tuple(ops), tuple(b)) for ops, b in zip(all_ops, buffers, strict=True))


def activation_memory(
    cfg: Config, plan: ParallelPlan, stage: int, *, offloaded: Sequence[int] = (), device_type: str = "cuda"
) -> Dict[str, int]:
    """Peak activation bytes of a rank of ``stage`` under ``cfg``'s recomputation.

    ``activations``: what the micro-batches in flight keep for backward (a recomputed unit or an
    offloaded layer keeps its input), at the point of the schedule where the most are
    (``pipeline.order``: with interleaving, (micro-batch, chunk) forwards, each weighted by its
    chunk), with the hidden-state buffers (``[b, s/TP, h]`` under sequence parallelism) of sends
    not yet known received and of messages that arrived early
    (``pipeline.transfers.link_buffers``); ``in_flight``: the most forwards awaiting their
    backward (chunk forwards with interleaving); ``transient``: the largest working set on top,
    the worst over the chunks of (a) the forward of the loss (a chunk of logits) or, with
    recomputation, one layer's no-grad forward; (b) the backward of the loss; (c) the backward
    of a layer: recomputed in full (its whole unit) when recomputing, plus its widest activation
    gradient, its largest weight gradient and the gradient buffers of weights called more than
    once (pseudo slots, tied embedding); (d) the word embedding's gradient. Offloaded modules
    (``megatron_p2r.offload``) always run recomputed with fetched weights.
    """
    cfg = local_sequence(cfg)
    ns = cfg.train.micro_batch_size * cfg.model.seq_length // (plan.layout.tp if plan.sequence_parallel else 1)
    hidden_bytes = ns * token_bytes(cfg)  # one micro-batch's hidden state: a chunk's input, a p2p message
    chunks = [
        _chunk_memory(cfg, plan, stage, c, offloaded, hidden_bytes, device_type) for c in range(plan.num_model_chunks)
    ]
    ops, buffers = stage_schedule(cfg, plan, stage)
    return {
        "held_per_microbatch": sum(held for held, _ in chunks),
        "in_flight": int(max_outstanding(ops)),
        "activations": int(max_outstanding(ops, lambda c: chunks[c][0], [hidden_bytes * b for b in buffers])),
        "transient": max(transient for _, transient in chunks),
    }


def korthikanti_layer_bytes(
    s: int, b: int, h: int, heads: int, t: int = 1, *, sequence_parallel: bool = False, selective: bool = False
) -> int:
    """Activation bytes per transformer layer by Korthikanti et al. 2022, Table 2 (16-bit
    activations, 1-byte dropout masks, unfused attention): 34sbh + 5as^2b without parallelism;
    with TP t: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism everything / t; selective
    recomputation drops the 5as^2b terms."""
    attention = 0 if selective else 5 * heads * s * s * b
    if sequence_parallel:
        return (34 * s * b * h + attention) // t
    return 10 * s * b * h + (24 * s * b * h + attention) // t
