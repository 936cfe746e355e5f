"""Multi-latent attention (DeepSeek-V2/V3, Megatron-LM's --multi-latent-attention), heads split over TP.

Keys and values come from one low-rank latent per token: ``kv_down_proj`` maps the hidden state to
``kv_lora_rank`` latent features plus ``qk_pos_emb_head_dim`` rotary key features shared by every
head; the latent is normalised (``kv_layernorm``, with --qk-layernorm as in megatron-core) and
``kv_up_proj`` expands it into each head's non-rotary key (``qk_head_dim``) and value
(``v_head_dim``). Queries go the same way through ``q_down_proj`` / ``q_layernorm`` /
``q_up_proj`` (--q-lora-rank), or straight through ``q_proj``. Each query head is its
non-rotary part then its rotary part; each key head its own non-rotary part then the shared rotary
key. Only the KV latent and the shared rotary key need caching at inference, the point of MLA.

Tensor parallelism as Megatron-LM: the down-projections (and latent norms) are replicated on every
TP rank; the up-projections are column-parallel over heads, the output row-parallel. Without
sequence parallelism each rank computes the (small) latents on the whole sequence; the
up-projection's input copy all-reduces the latent's gradient in backward, and the shared rotary key
passes an explicit copy, so the replicated weights get whole, identical gradients. With sequence
parallelism the latents are computed on the rank's sequence shard and all-gathered (cheaper than
gathering the hidden state), so the replicated weights get partial gradients, summed over TP
(``layout.tensor_specs.SEQUENCE_PARALLEL_PARTIAL``).

Rotary embeddings: megatron-core's MLA rope, i.e. DeepSeek's interleaved pairs ``(x0, x1), (x2,
x3)...`` (the layout of DeepSeek's and Megatron-LM's weights) rotated as rotate-half after
de-interleaving, with YaRN frequencies and YaRN's concentration factor on the tables; the softmax
scale is ``mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_p2r.config import ModelConfig
from megatron_p2r.model.attention import rotate_half
from megatron_p2r.model.norm import make_norm
from megatron_p2r.model.yarn import yarn_concentration, yarn_inv_freq, yarn_mscale, yarn_tables
from megatron_p2r.parallel import random as tp_random
from megatron_p2r.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_p2r.parallel.mappings import copy_to_region, gather_from_sequence_region
from megatron_p2r.parallel.sharding import make_param
from megatron_p2r.parallel.state import ParallelState

# megatron-core's MLATransformerConfig defaults, which its command line does not set for MLA
# (--yarn-* flags feed standard attention's YaRN only): DeepSeek-V3's own values.
YARN_ORIGINAL_CONTEXT = 4096
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def softmax_scale(m: ModelConfig) -> float:
    """DeepSeek-V3's softmax scale: 1/sqrt(query head dim) times mscale(factor, mscale_all_dim)^2."""
    return yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim) ** 2 / math.sqrt(m.q_head_dim)


@functools.lru_cache(maxsize=8)
def latent_rotary_tables(m: ModelConfig, seq_len: int, device) -> tuple:
    """cos, sin [seq, qk_pos_emb_head_dim] for MLA's rotary part, YaRN's concentration factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) applied to both (cached: every layer
    of a forward and every forward of a run read the same)."""
    inv_freq = yarn_inv_freq(
        m.qk_pos_emb_head_dim,
        m.rotary_base,
        m.rotary_scaling_factor,
        YARN_ORIGINAL_CONTEXT,
        YARN_BETA_FAST,
        YARN_BETA_SLOW,
        True,
        device,
    )
    return yarn_tables(inv_freq, seq_len, yarn_concentration(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim))


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of ``x`` [..., s, d]: de-interleave (even dims, then odd), then
    rotate-half (megatron-core's ``mla_rotary_interleaved``, transformers' DeepSeek-V3 rope). The
    result stays de-interleaved: queries and keys alike, so their dot products are unchanged."""
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class LatentAttention(nn.Module):
    """Megatron-LM's MLASelfAttention: parameter names ``q_proj`` or ``q_down_proj`` /
    ``q_layernorm`` / ``q_up_proj``, ``kv_down_proj`` / ``kv_layernorm`` / ``kv_up_proj``,
    ``proj`` (its ``linear_proj``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        device=None,
        *,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
    ):
        super().__init__()
        h, tp, heads = cfg.hidden_size, ps.tp_size, cfg.num_attention_heads
        self.local_heads = heads // tp
        self.qk_head_dim, self.pos_dim, self.v_head_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        self.dropout = cfg.attention_dropout
        self.device, self.group = ps.device, ps.group("tp")
        self.sequence_parallel, self.recompute_core = sequence_parallel, recompute_core
        std = cfg.init_method_std
        up = dict(bias=False, init_std=std, sequence_parallel=sequence_parallel, device=device)
        self.q_proj = self.q_down_proj = self.q_layernorm = self.q_up_proj = None
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * cfg.q_head_dim, ps, **up)
        else:
            self.q_down_proj = _replicated(cfg.q_lora_rank, h, std, device)
            self.q_layernorm = make_norm(cfg, device, cfg.q_lora_rank) if cfg.qk_layernorm else None
            self.q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * cfg.q_head_dim, ps, **up)
        self.kv_down_proj = _replicated(cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h, std, device)
        self.kv_layernorm = make_norm(cfg, device, cfg.kv_lora_rank) if cfg.qk_layernorm else None
        self.kv_up_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * (cfg.qk_head_dim + cfg.v_head_dim), ps, **up)
        self.proj = RowParallelLinear(
            heads * cfg.v_head_dim,
            h,
            ps,
            bias=cfg.add_bias,
            init_std=std / math.sqrt(2 * cfg.num_layers),
            sequence_parallel=sequence_parallel,
            device=device,
        )

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, local heads x (qk_head_dim + qk_pos_emb_head_dim)] over the whole sequence."""
        if self.q_proj is not None:
            return self.q_proj(x)
        latent = F.linear(x, self.q_down_proj.weight)
        if self.q_layernorm is not None:
            latent = self.q_layernorm(latent)
        return self.q_up_proj(latent)

    def _shared_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        """The rotary key every local head reads, over the whole sequence; its gradient summed over
        the TP ranks (each holds the gradient of its own heads only)."""
        if self.sequence_parallel:
            return gather_from_sequence_region(k_rot, self.group)
        return copy_to_region(k_rot, self.group)

    def project(self, x: torch.Tensor, rope) -> tuple:
        """q, k [b, local heads, s, q_head_dim] (rotary part last, rotated) and v [b, local heads,
        s, v_head_dim], s the whole sequence (a sequence shard ``x`` is gathered as latents)."""
        q = self._queries(x)
        b, s = q.shape[:2]
        q = q.view(b, s, self.local_heads, -1).transpose(1, 2)
        latent, k_rot = F.linear(x, self.kv_down_proj.weight).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv = self.kv_up_proj(latent).view(b, s, self.local_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        q_nope, q_rot = q.split([self.qk_head_dim, self.pos_dim], dim=-1)
        k_rot = self._shared_key(k_rot).unsqueeze(1)  # [b, 1, s, pos]: one key for all heads
        cos, sin = rope
        q_rot, k_rot = (
            apply_interleaved_rotary(q_rot, cos[:s], sin[:s]),
            apply_interleaved_rotary(k_rot, cos[:s], sin[:s]),
        )
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.local_heads, -1, -1)], dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        b, s = q.shape[0], q.shape[2]
        if self.recompute_core and torch.is_grad_enabled():
            y = tp_random.checkpoint(self.core, q, k, v, device=self.device, draws=self.training and self.dropout > 0)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.v_head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T * scale) V, causal, with attention dropout; SDPA takes a value head
        dimension other than the query/key one. What selective recomputation recomputes."""
        p = self.dropout if self.training else 0.0
        with tp_random.get_rng_tracker(self.device).fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.scale)


def _replicated(out_features: int, in_features: int, std: float, device) -> nn.Module:
    """A down-projection: one whole [out, in] weight on every TP rank, no bias (megatron-core's
    ``parallel_mode="duplicated"`` linear)."""
    module = nn.Module()
    module.weight = make_param((out_features, in_features), init=("normal", std), device=device)
    return module
