"""One block of attention that also returns its log-sum-exp, and the block's backward given the
merged output and log-sum-exp: what ring attention needs and ``F.scaled_dot_product_attention``
does not return.

On CPU without dropout the block runs torch's fused flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, the kernels SDPA itself
dispatches to; they take GQA's fewer KV heads as they are). Elsewhere (dropout, CUDA) a math
kernel in fp32: the CPU flash kernel refuses dropout, and this one saves the block's dropout
mask for its backward. With a soft-cap (``softcap`` C: scores become C * tanh(scores / C)
before the mask, Gemma 2's attention) always the math kernel: no fused kernel soft-caps.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_p2r.context.blocks import Block

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _uses_flash(q: torch.Tensor, dropout_p: float, softcap: Optional[float] = None) -> bool:
    return q.device.type == "cpu" and dropout_p == 0.0 and softcap is None


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flash kernel's mask: additive, in the inputs' dtype (it rejects bool)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    kind: Block,
    visible: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float] = None,
) -> tuple:
    """fp32 scores [b, kv heads, group, queries, keys] (query heads grouped by their KV head),
    soft-capped then masked, and with ``softcap`` the unmasked tanh(scores / C) (its derivative
    1 - tanh^2 is what the backward needs), else None."""
    b, heads, length, d = q.shape
    groups = k.shape[1]
    s = (q.float().view(b, groups, heads // groups, length, d) @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if kind is Block.CAUSAL:
        visible = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril()
    return (s if visible is None else s.masked_fill(~visible, float("-inf"))), capped


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kind: Block,
    visible: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
    softcap: Optional[float] = None,
) -> tuple:
    """(out in q's dtype, lse fp32 [b, heads, queries], dropout keep mask or None) of one block;
    ``visible`` [queries, keys] for a MASKED block. A query that sees no key of the block gets
    lse -inf, so it adds nothing when merged."""
    if _uses_flash(q, dropout_p, softcap):
        bias = _bias(visible, q.dtype) if kind is Block.MASKED else None
        out, lse = _FLASH(q, k, v, 0.0, kind is Block.CAUSAL, attn_mask=bias, scale=scale)
        if kind is Block.MASKED:  # the kernel reports 0 for a fully masked row
            lse = lse.masked_fill(~visible.any(-1), float("-inf"))
        return out, lse.float(), None
    s = _scores(q, k, kind, visible, scale, softcap)[0]
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.masked_fill(lse.isinf(), 0.0).unsqueeze(-1))
    keep = None
    if dropout_p > 0:
        keep = torch.rand_like(p) >= dropout_p
        p = p * keep / (1 - dropout_p)
    out = (p @ v.float().unsqueeze(2)).flatten(1, 2)
    return out.to(q.dtype), lse.flatten(1, 2), keep


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    kind: Block,
    visible: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
    keep: Optional[torch.Tensor],
    softcap: Optional[float] = None,
) -> tuple:
    """fp32 (dq, dk, dv) of one block, given the merged ``out`` and ``lse`` of these queries over
    every key (so exp(score - lse) is the block's share of the whole softmax) and ``delta`` =
    rowsum(grad_out * out) [b, heads, queries]."""
    if _uses_flash(q, dropout_p, softcap):
        bias = _bias(visible, q.dtype) if kind is Block.MASKED else None
        grads = _FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, kind is Block.CAUSAL, attn_mask=bias, scale=scale)
        return tuple(g.float() for g in grads)
    b, heads, length, d = q.shape
    groups = k.shape[1]
    s, capped = _scores(q, k, kind, visible, scale, softcap)
    p = torch.exp(s - lse.view(b, groups, heads // groups, length, 1))
    g = grad_out.float().view(b, groups, heads // groups, length, d)
    dp = g @ v.float().unsqueeze(2).transpose(-1, -2)
    kept = p
    if keep is not None:
        dp = dp * keep / (1 - dropout_p)
        kept = p * keep / (1 - dropout_p)
    dv = (kept.transpose(-1, -2) @ g).sum(2)
    ds = p * (dp - delta.view(b, groups, heads // groups, length, 1))
    if capped is not None:  # d(C tanh(s / C)) / ds
        ds = ds * (1 - capped * capped)
    ds = ds * scale
    dq = (ds @ k.float().unsqueeze(2)).flatten(1, 2)
    dk = (ds.transpose(-1, -2) @ q.float().view(b, groups, heads // groups, length, d)).sum(2)
    return dq, dk, dv
