"""The fixture model's own forward, from Megatron's global tensors and written after
Megatron-LM's modules (no code of megatron_p2r): the independent reference of the import tests.

[s, b, h] activations as Megatron keeps them; fused QKV viewed as [s, b, groups, (q, k, v) x
head_dim] (transformer/attention.py ``get_query_key_value_tensors``); rotary embeddings rotate
halves (models/common/embeddings/rope_utils.py, ``rotary_interleaved`` off); SwiGLU chunks fc1's
output into gate and up (transformer/mlp.py); GELU with biases is the fused ``bias_gelu`` of the
default --bias-gelu-fusion (fusions/fused_bias_gelu.py: the tanh formula); the router takes the
top-k logits and a softmax over them (moe/moe_utils.py ``topk_softmax_with_capacity``, pre-softmax
off) and weights each expert's output; the loss is the mean cross entropy over the padded
vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.convert.megatron.fixtures import Spec


def _norm(x, w, prefix, spec: Spec):
    """LayerNorm or RMSNorm over the last dimension (the hidden size, or a head for q/k norms)."""
    gamma = w[prefix + "weight"].float() + (1.0 if spec.layernorm_1p else 0.0)
    if spec.family == "gpt":
        return F.layer_norm(x, (x.shape[-1],), gamma, w[prefix + "bias"].float(), eps=1e-5)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma


def _linear(x, w, prefix):
    bias = w.get(prefix + "bias")
    return F.linear(x, w[prefix + "weight"].float(), None if bias is None else bias.float())


def _rope(t, percent, base=10000.0):
    """t [s, b, heads, d]: Megatron's RotaryEmbedding (rotate-half) on the first d x percent
    dimensions, the rest passed through (rope_utils.py ``_apply_rotary_pos_emb_bshd``)."""
    s, d = t.shape[0], int(t.shape[-1] * percent)
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    t, t_pass = t[..., :d], t[..., d:]
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat([t * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin(), t_pass], dim=-1)


def _attention(x, w, p, spec: Spec):
    s, b, _ = x.shape
    heads, groups, d = spec.heads, spec.query_groups, spec.kv_channels
    per_group = heads // groups
    mixed = _linear(x, w, p + "self_attention.linear_qkv.").view(s, b, groups, (per_group + 2) * d)
    q, k, v = torch.split(mixed, [per_group * d, d, d], dim=3)
    q = q.reshape(s, b, heads, d)
    if spec.qk_layernorm:
        q = _norm(q, w, p + "self_attention.q_layernorm.", spec)
        k = _norm(k, w, p + "self_attention.k_layernorm.", spec)
    if spec.family != "gpt":
        q, k = _rope(q, spec.rotary_percent), _rope(k, spec.rotary_percent)
    k, v = k.repeat_interleave(per_group, dim=2), v.repeat_interleave(per_group, dim=2)  # query head i: group i // n
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, heads * d)
    return _linear(context, w, p + "self_attention.linear_proj.")


def _mlp(x, w, prefix, spec: Spec):
    y = _linear(x, w, prefix + "linear_fc1.")
    if spec.glu:
        gate, up = torch.chunk(y, 2, dim=-1)
        y = F.silu(gate) * up
    elif spec.bias:  # fused_bias_gelu.bias_gelu, Megatron's default with biases
        y = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
    else:
        y = F.gelu(y)
    return _linear(y, w, prefix + "linear_fc2.")


def _moe(x, w, p, spec: Spec):
    tokens = x.reshape(-1, x.shape[-1])
    logits = F.linear(tokens, w[p + "mlp.router.weight"].float())
    top, index = torch.topk(logits, spec.topk, dim=-1)
    probs = top.softmax(-1)
    out = torch.zeros_like(tokens)
    for e in range(spec.experts):
        for slot in range(spec.topk):
            rows = (index[:, slot] == e).nonzero().flatten()
            if rows.numel():
                out[rows] += probs[rows, slot, None] * _mlp(tokens[rows], w, f"{p}mlp.experts.{e}.", spec)
    return out.view_as(x)


def megatron_loss(spec: Spec, w, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean next-token loss of the Megatron model ``w`` on ``tokens`` [b, s] (fp32)."""
    x = w["embedding.word_embeddings.weight"].float()[tokens.t()]  # [s, b, h]
    if spec.family == "gpt":
        x = x + w["embedding.position_embeddings.weight"].float()[: tokens.shape[1], None]
    for i in range(spec.layers):
        p = f"decoder.layers.{i}."
        x = x + _attention(_norm(x, w, p + "input_layernorm.", spec), w, p, spec)
        h = _norm(x, w, p + "pre_mlp_layernorm.", spec)
        x = x + (_moe(h, w, p, spec) if spec.experts else _mlp(h, w, p + "mlp.", spec))
    x = _norm(x, w, "decoder.final_layernorm.", spec)
    out = w["output_layer.weight" if spec.untied else "embedding.word_embeddings.weight"].float()
    logits = F.linear(x, out)  # [s, b, padded vocab]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1)).item()
