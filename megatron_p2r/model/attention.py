"""Causal self-attention with heads split over TP; the kernel is torch's SDPA.

Plain causal attention passes ``is_causal`` (fused kernels, no s x s tensor). A sliding window
passes a boolean mask (on CPU torch's fused flash kernel still runs; the masked blocks are
computed all the same). Attention sinks (--softmax-type learnable / off-by-one) add one key per
head whose value is 0 and whose logit is the head's offset, given as an additive float mask:
SDPA has no sink argument, and with a float mask torch runs its math kernel on CPU (s x s
tensors) and the memory-efficient one on CUDA. Soft-capped scores (--attn-logit-softcapping,
Gemma 2) run the math kernel of ``context.kernels`` (SDPA cannot soft-cap) as one block of the
whole sequence: it keeps q, k, v, its output and the log-sum-exp, as a fused kernel does, and
recomputes the s x s scores in backward.

Under context parallelism (CP > 1) q, k and v hold this rank's two chunks of the sequence
(``context.chunks``) and the core is ``context.attention.context_parallel_attention`` over the
CP group (``--cp-comm-type``); the projections and everything else run unchanged on the chunks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.context.blocks import Block
from megatron_p2r.context.kernels import block_backward, block_forward
from megatron_p2r.model.norm import HeadsRMSNorm, make_qk_norm
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.model.yarn import yarn_concentration, yarn_inv_freq, yarn_tables
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState


def llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> torch.Tensor:
    """Llama 3.1's rotary frequency scaling as megatron-core computes it (RotaryEmbedding._apply_scaling):
    wavelengths beyond the original context / low_freq_factor are slowed by ``factor``, those
    below context / high_freq_factor kept, the band between blended smoothly."""
    low_freq_wavelen, high_freq_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(
    seq_len: int,
    rotary_dim: int,
    base: float,
    device,
    rope_scaling_factor: Optional[float] = None,
    seq_len_interpolation_factor: Optional[float] = None,
) -> tuple:
    """cos, sin [seq, rotary_dim] in the rotate-half convention (as Llama in transformers), with
    megatron-core's optional Llama 3.1 scaling (``rope_scaling_factor``) and linear position
    interpolation (positions times 1 / ``seq_len_interpolation_factor``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    if rope_scaling_factor is not None:
        inv_freq = llama3_scaled(inv_freq, rope_scaling_factor)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    if seq_len_interpolation_factor is not None:
        positions *= 1 / seq_len_interpolation_factor
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def model_rotary_tables(m: ModelConfig, seq_len: int, device) -> tuple:
    """``rotary_tables`` for a model's config (its base, rotated dimensions and scaling flags), or
    YaRN's under --rope-type yarn (megatron-core's YarnRotaryEmbedding: model/yarn.py); with
    --rotary-base-local the sliding-window layers' own tables follow, unscaled: (cos, sin,
    cos_local, sin_local), which ``layer_rotary_tables`` picks from. Unscaled because that is Gemma
    3's rotary (its full layers scaled, e.g. linearly by 8; its sliding ones default with the local
    base), and the one model with a local base."""
    if m.yarn:
        inv_freq = yarn_inv_freq(
            m.rotary_dim,
            m.rotary_base,
            m.rotary_scaling_factor,
            m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast,
            m.yarn_beta_slow,
            m.yarn_correction_range_round_to_int,
            device,
        )
        scaled = yarn_tables(inv_freq, seq_len, yarn_concentration(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim))
    else:
        scaled = rotary_tables(
            seq_len,
            m.rotary_dim,
            m.rotary_base,
            device,
            m.rope_scaling_factor if m.use_rope_scaling else None,
            m.rotary_seq_len_interpolation_factor,
        )
    if m.rotary_base_local is None:
        return scaled
    return scaled + rotary_tables(seq_len, m.rotary_dim, m.rotary_base_local, device)


def layer_rotary_tables(rope: tuple, windowed: bool) -> tuple:
    """(cos, sin) of a layer: the local ones (Gemma 3's sliding layers) when ``rope`` has them and
    the layer is windowed, else the global ones."""
    return rope[2:] if windowed and len(rope) == 4 else rope[:2]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]: its first ``cos.shape[-1]`` dimensions rotated, the rest (--rotary-percent
    below 1) passed through, as Megatron-LM and transformers' partial rotary do."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos + rotate_half(x) * sin).to(x.dtype)
    x_rot = x[..., :rot]
    return torch.cat([(x_rot * cos + rotate_half(x_rot) * sin).to(x.dtype), x[..., rot:]], dim=-1)


@functools.lru_cache(maxsize=8)
def window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[s, s] bool, True where query i sees key j: i - window <= j <= i (Megatron-LM's
    ``get_sliding_window_causal_mask``, negated). Cached: the windowed layers of a run share one."""
    i = torch.arange(seq_len, device=device)
    behind = i[:, None] - i[None, :]
    return (behind >= 0) & (behind <= window)


def with_sink(k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, logits: torch.Tensor) -> tuple:
    """k, v with one more key per head, whose logit is ``logits[h]`` for every query and whose value
    is 0, and the additive mask [heads, s, s + 1] that says so: exp(logit) joins each softmax
    denominator and nothing joins the output (Megatron-LM's ``SoftmaxOne``, gpt-oss's sinks)."""
    zeros = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    blocked = torch.zeros(allowed.shape, dtype=k.dtype, device=k.device).masked_fill(~allowed, float("-inf"))
    heads, s = logits.shape[0], allowed.shape[0]
    sink = logits.to(k.dtype).view(heads, 1, 1).expand(heads, s, 1)
    return k, v, torch.cat([blocked.expand(heads, s, s), sink], dim=-1)


class _SoftcappedAttention(torch.autograd.Function):
    """Causal (or windowed) attention with soft-capped scores: the math block kernel over the whole
    sequence, saving what a fused kernel saves (the dropout keep mask too, when drawn)."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, softcap, dropout_p):
        s = q.shape[2]
        kind, visible = (Block.CAUSAL, None) if window is None else (Block.MASKED, window_mask(s, window, q.device))
        out, lse, keep = block_forward(q, k, v, kind, visible, scale, dropout_p, softcap)
        ctx.save_for_backward(q, k, v, out, lse, *([] if keep is None else [keep]))
        ctx.args = kind, visible, scale, dropout_p, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *keep = ctx.saved_tensors
        kind, visible, scale, dropout_p, softcap = ctx.args
        delta = (grad_out.float() * out.float()).sum(-1)  # rowsum(dO * O) [b, heads, s]
        dq, dk, dv = block_backward(
            grad_out, q, k, v, out, lse, delta, kind, visible, scale, dropout_p, keep[0] if keep else None, softcap
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def softcapped_attention(q, k, v, window: Optional[int], scale: float, softcap: float, dropout_p: float):
    """softmax(C tanh(q.k * scale / C) + causal/window mask) v, q [b, heads, s, d], k and v
    [b, key/value heads, s, d] (grouped-query attention: head i uses key/value head i // (heads/groups))."""
    return _SoftcappedAttention.apply(q, k, v, window, scale, softcap, dropout_p)


class Attention(nn.Module):
    """Query, key and value projections split over TP by whole heads; the output is row-parallel.

    Without --group-query-attention QKV is one column-parallel matrix with rows
    ``[heads, (q, k, v), head_dim]`` (Megatron-LM's fused layout, one group per head). With it,
    ``query`` ``[heads, head_dim]`` and ``key_value`` ``[groups, (k, v), head_dim]`` are separate
    matrices, so that when TP exceeds the groups each rank can hold the one key/value head its
    query heads use: TP/groups consecutive ranks hold replicas of it, whose partial gradients
    the ParallelPlan sums over those ranks (``layout.tensor_specs.HeadRows``, docs/architecture.md).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        device=None,
        *,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        window: Optional[int] = None,
        cp_comm_type: str = "p2p",
    ):
        super().__init__()
        h, d, tp = cfg.hidden_size, cfg.head_dim, ps.tp_size
        self.cp_group = ps.group("cp") if ps.cp_size > 1 else None
        self.cp_comm_type = cp_comm_type
        heads, groups = cfg.num_attention_heads, cfg.query_groups
        self.head_dim = d
        self.local_heads = heads // tp
        self.local_groups = max(groups // tp, 1)
        self.dropout = cfg.attention_dropout
        self.device = ps.device
        self.recompute_core = recompute_core
        self.window = window  # keys before the query this layer sees (ModelConfig.attention_window)
        self.softmax_scale = cfg.softmax_scale  # None: SDPA's 1/sqrt(d)
        self.softcap = cfg.attn_logit_softcapping
        # Megatron-LM's softmax offsets: learned per head (normal init, no weight decay), or 0 for off-by-one.
        self.softmax_type = cfg.softmax_type
        self.softmax_offset = None
        if cfg.softmax_type == "learnable":
            self.softmax_offset = make_param(
                (self.local_heads,), tp_dim=0, init=("normal", cfg.init_method_std), no_wd=True, device=device
            )
        projection = dict(
            bias=cfg.qkv_bias, init_std=cfg.init_method_std, sequence_parallel=sequence_parallel, device=device
        )
        self.qkv = self.query = self.key_value = None
        if cfg.group_query_attention:
            self.query = ColumnParallelLinear(h, heads * d, ps, **projection)
            self.key_value = ColumnParallelLinear(h, 2 * groups * d, ps, tp_replicas=max(tp // groups, 1), **projection)
        else:
            self.qkv = ColumnParallelLinear(h, 3 * heads * d, ps, **projection)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm and cfg.qk_layernorm_over_heads:
            group, replicas = ps.group("tp"), max(tp // groups, 1)
            self.q_layernorm = HeadsRMSNorm(self.local_heads, d, cfg.norm_epsilon, group, tp, 1, device)
            self.k_layernorm = HeadsRMSNorm(self.local_groups, d, cfg.norm_epsilon, group, tp, replicas, device)
        else:
            self.q_layernorm, self.k_layernorm = make_qk_norm(cfg, device), make_qk_norm(cfg, device)
        self.proj = RowParallelLinear(
            heads * d,
            h,
            ps,
            bias=cfg.add_bias,
            init_std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
            sequence_parallel=sequence_parallel,
            device=device,
        )

    def _project(self, x: torch.Tensor) -> tuple:
        """q [b, local heads, s, d]; k, v [b, local key/value heads, s, d], s the whole sequence
        (the projections all-gather a sequence shard)."""
        if self.qkv is not None:
            qkv = self.qkv(x)
            qkv = qkv.view(*qkv.shape[:2], self.local_heads, 3, self.head_dim)
            return tuple(t.transpose(1, 2) for t in qkv.unbind(dim=3))
        q = self.query(x)
        b, s = q.shape[:2]
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        kv = self.key_value(x).view(b, s, self.local_groups, 2, self.head_dim)
        k, v = (t.transpose(1, 2) for t in kv.unbind(dim=3))
        return q, k, v

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        q, k, v = self._project(x)  # the whole sequence, also when x is a sequence shard
        b, s = q.shape[0], q.shape[2]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            cos, sin = layer_rotary_tables(rope, self.window is not None)
            q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        if self.recompute_core and torch.is_grad_enabled():
            y = tp_random.checkpoint(self.core, q, k, v, device=self.device, draws=self.training and self.dropout > 0)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def _context_parallel_core(self, q, k, v, offsets: Optional[torch.Tensor], p: float) -> torch.Tensor:
        """The core over the whole sequence, from this rank's chunks (``--cp-comm-type``)."""
        from megatron_p2r.context.attention import context_parallel_attention

        return context_parallel_attention(
            q,
            k,
            v,
            group=self.cp_group,
            comm_type=self.cp_comm_type,
            window=self.window,
            sink_logits=offsets,
            dropout_p=p,
            enable_gqa=self.local_groups != self.local_heads,
        )

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V (or --softmax-scale instead of 1/sqrt(d)) with attention dropout: what selective recomputation
        (``recompute_core``, Megatron's "core_attn") recomputes in backward."""
        p = self.dropout if self.training else 0.0
        offsets = None
        if self.softmax_type != "vanilla":
            offsets = self.softmax_offset if self.softmax_offset is not None else q.new_zeros(self.local_heads)
        # Heads are split over TP (and tokens over CP), so their dropout masks must differ between those ranks.
        with tp_random.get_rng_tracker(self.device).fork() if p > 0 else contextlib.nullcontext():
            if self.cp_group is not None:
                return self._context_parallel_core(q, k, v, offsets, p)
            if self.softcap is not None:
                scale = self.softmax_scale if self.softmax_scale is not None else 1 / math.sqrt(self.head_dim)
                return softcapped_attention(q, k, v, self.window, scale, self.softcap, p)
            mask = None
            if self.window is not None or offsets is not None:
                s = q.shape[2]
                mask = window_mask(s, s if self.window is None else self.window, q.device)
            if offsets is not None:
                k, v, mask = with_sink(k, v, mask, offsets)
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=p,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=self.local_groups != self.local_heads,
            )
