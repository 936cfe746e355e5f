"""The output layer and the cross entropy, fused and chunked over tokens, vocabulary split over TP.

Full logits never exist: each rank holds its ``[V/TP, h]`` slice of the output weight, and
``output_cross_entropy`` walks the tokens in chunks of about ``CHUNK_ELEMENTS / (V/TP)``: per
chunk it computes the logits ``x_c W^T`` (in the compute dtype: bf16 logits under bf16
autocast), takes their log-sum-exp and target logit in fp32 (the TP ranks' shares combined by
one all-gather of ``[chunk, 2]``), and frees them. At any moment O(chunk x V/TP) logits exist.

Two ways to get the gradient, by what the caller asks for:

- with a ``loss_mask`` it returns the masked *sum* of the token losses (what the schedules
  optimise, ``pipeline/schedules.py``). Its gradient then differs from the one computed here
  by a scalar only, so the backward is **fused into the forward**: each chunk's
  ``(softmax - onehot) x mask`` goes straight into the input's gradient rows and the weight's
  gradient, and backward multiplies both by the incoming scalar. Kept in between: those two
  gradients (``[tokens, h]`` -- this rank's sequence shard under sequence parallelism -- and
  ``[V/TP, h]``, both accumulated in fp32 over the chunks, also with 16-bit weights), no logits
  and no input;
- without, it returns per-token losses ``[b, s]`` for any downstream reduction, keeps the
  input, each token's log-sum-exp and target, and backward recomputes each chunk's logits (one
  more ``tokens x h x V/TP`` matmul) to weight ``softmax - onehot`` by the per-token gradient.

With ``softcap`` C (Gemma 2's final_logit_softcapping) each chunk's fp32 logits become
C * tanh(logits / C) before the softmax, and the gradient is multiplied by 1 - tanh^2: elementwise
on each rank's vocabulary slice, so TP changes nothing.

fp32 throughout without autocast (``tests/parallel/test_cross_entropy.py`` compares both with
a float64 reference on a padded vocabulary, TP 1/2/4, with and without sequence parallelism).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.parallel.mappings import all_gather_sequence, copy_to_region, reduce_scatter_sequence

CHUNK_ELEMENTS = 1 << 21  # logits per chunk (8 MiB in fp32)


def chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk: about CHUNK_ELEMENTS logits of this rank's vocabulary slice."""
    return max(1, CHUNK_ELEMENTS // local_vocab)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _softmax_statistics(logits: torch.Tensor, local_target: torch.Tensor, group) -> Tuple[torch.Tensor, ...]:
    """Each token's log-sum-exp and target logit over the whole vocabulary (every TP rank's
    slice), and its shift: the fp32 ``logits`` become ``exp(logits - shift)`` in place, so the
    softmax is ``logits x exp(shift - lse)`` (one exponential per logit for the loss and its
    gradient)."""
    inside = (local_target >= 0) & (local_target < logits.shape[-1])
    picked = logits.gather(-1, local_target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    shift = logits.amax(dim=-1)
    local_lse = shift + logits.sub_(shift.unsqueeze(-1)).exp_().sum(dim=-1).log_()
    stats = torch.stack([local_lse, picked.masked_fill_(~inside, 0.0)], dim=-1)
    if group is not None:  # the shards' log-sum-exps combine by a log-sum-exp, their target logits by a sum
        parts = stats.new_empty((dist.get_world_size(group) * stats.shape[0], 2))
        dist.all_gather_single(parts, stats, group=group)
        parts = parts.view(-1, *stats.shape)
        return torch.logsumexp(parts[..., 0], dim=0), parts[..., 1].sum(0), shift
    return stats[:, 0], stats[:, 1], shift


def _accumulate_gradients(
    exp: torch.Tensor,
    softmax_scale: torch.Tensor,
    weights: torch.Tensor,
    local_target: torch.Tensor,
    w: torch.Tensor,
    inputs: torch.Tensor,
    grad_inputs: torch.Tensor,
    grad_w: torch.Tensor,
    capped: Optional[torch.Tensor] = None,
) -> None:
    """One chunk: ``(softmax - onehot) x weights`` per token (the softmax is ``exp x
    softmax_scale``; formed in place on the fp32 ``exp``, then in the compute dtype), times
    1 - ``capped``^2 under a soft-cap (``capped``: tanh(logits / C)), into the chunk's
    input-gradient rows and added to the weight gradient."""
    d = exp.mul_((softmax_scale * weights).unsqueeze(-1))
    rows = ((local_target >= 0) & (local_target < d.shape[-1])).nonzero().squeeze(-1)
    d[rows, local_target[rows]] -= weights[rows]
    if capped is not None:
        d.mul_(1 - capped * capped)
    d = d.to(w.dtype)
    grad_inputs.copy_(d @ w)
    grad_w.add_(d.t() @ inputs)


def soft_capped(logits: torch.Tensor, softcap: Optional[float]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(C * tanh(logits / C), tanh(logits / C)), or (logits, None) without a soft-cap C."""
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def _chunk_logits(inputs: torch.Tensor, w: torch.Tensor, softcap: Optional[float]) -> tuple:
    """A chunk's fp32 logits (soft-capped) and tanh(logits / C) or None."""
    return soft_capped((inputs @ w.t()).float(), softcap)


def _forward_chunk(
    inputs: torch.Tensor,
    w: torch.Tensor,
    local_target: torch.Tensor,
    group,
    gradients: Optional[tuple],
    softcap: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A chunk of tokens' log-sum-exp and target logit; with ``gradients`` (per-token weights,
    the chunk's input-gradient rows, the weight gradient) their gradients too. Its logits die
    on return, before the next chunk's exist."""
    exp, capped = _chunk_logits(inputs, w, softcap)
    lse, target, shift = _softmax_statistics(exp, local_target, group)
    if gradients is not None:
        weights, grad_inputs, grad_w = gradients
        scale = (shift - lse).exp_()
        _accumulate_gradients(exp, scale, weights, local_target, w, inputs, grad_inputs, grad_w, capped)
    return lse, target


def _backward_chunk(
    inputs: torch.Tensor,
    w: torch.Tensor,
    lse: torch.Tensor,
    local_target: torch.Tensor,
    grad_loss: torch.Tensor,
    grad_inputs: torch.Tensor,
    grad_w: torch.Tensor,
    softcap: Optional[float] = None,
) -> None:
    """A chunk's gradients from its recomputed logits and the saved log-sum-exp."""
    logits, capped = _chunk_logits(inputs, w, softcap)
    softmax = logits.sub_(lse.unsqueeze(-1)).exp_()
    ones = torch.ones_like(lse)
    _accumulate_gradients(softmax, ones, grad_loss, local_target, w, inputs, grad_inputs, grad_w, capped)


class _OutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, loss_mask, group, gather_sequence, gradients, softcap):
        ctx.softcap = softcap
        ctx.x_dtype, ctx.w_dtype, dtype = x.dtype, weight.dtype, _compute_dtype(x)
        ctx.group, ctx.gather_sequence, ctx.fused = group, gather_sequence, loss_mask is not None
        x = x.to(dtype)  # what is gathered (and, per token, saved): the compute dtype's bytes
        with torch.autocast(x.device.type, enabled=False):
            full = all_gather_sequence(x, group) if gather_sequence else x
            inputs, w = full.reshape(-1, full.shape[-1]), weight.to(dtype)
            local_target = target.reshape(-1) - (dist.get_rank(group) * w.shape[0] if group is not None else 0)
            losses = inputs.new_empty(inputs.shape[0], dtype=torch.float32)
            lse = None if ctx.fused else torch.empty_like(losses)
            gradients = gradients and ctx.fused
            if gradients:
                grad_inputs = torch.empty(inputs.shape, dtype=torch.float32, device=x.device)
                grad_w, mask = torch.zeros_like(weight, dtype=torch.float32), loss_mask.reshape(-1).float()
            step = chunk_tokens(w.shape[0])
            for start in range(0, inputs.shape[0], step):
                rows = slice(start, start + step)
                chunk_lse, chunk_target = _forward_chunk(
                    inputs[rows],
                    w,
                    local_target[rows],
                    group,
                    (mask[rows], grad_inputs[rows], grad_w) if gradients else None,
                    softcap,
                )
                losses[rows] = chunk_lse - chunk_target
                if lse is not None:
                    lse[rows] = chunk_lse
        if not ctx.fused:
            ctx.save_for_backward(x, weight, local_target, lse)
            return losses.view(target.shape)
        if gradients:
            grad_x = grad_inputs.view(full.shape)
            ctx.save_for_backward(reduce_scatter_sequence(grad_x, group) if gather_sequence else grad_x, grad_w)
        return (losses * loss_mask.reshape(-1).to(losses.dtype)).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.fused:  # d(sum)/d(inputs) was computed in forward: scale it
            grad_x, grad_w = ctx.saved_tensors
            return (
                (grad_x * grad_loss).to(ctx.x_dtype),
                (grad_w * grad_loss).to(ctx.w_dtype),
                None,
                None,
                None,
                None,
                None,
                None,
            )
        x, weight, local_target, lse = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group) if ctx.gather_sequence else x
        inputs, w = full.reshape(-1, full.shape[-1]), weight.to(x.dtype)
        grad_loss = grad_loss.reshape(-1).float()
        grad_inputs = torch.empty(inputs.shape, dtype=torch.float32, device=x.device)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        step = chunk_tokens(w.shape[0])
        for start in range(0, inputs.shape[0], step):
            rows = slice(start, start + step)
            chunk = (inputs[rows], w, lse[rows], local_target[rows], grad_loss[rows], grad_inputs[rows], grad_w)
            _backward_chunk(*chunk, ctx.softcap)
        grad_x = grad_inputs.view(full.shape)
        if ctx.gather_sequence:
            grad_x = reduce_scatter_sequence(grad_x, ctx.group)
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), None, None, None, None, None, None


def output_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    sequence_parallel: bool = False,
    loss_mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Cross entropy of hidden states ``x`` (``[b, s, h]``, or this rank's sequence shard
    ``[b, s/TP, h]`` under sequence parallelism) through the vocabulary-parallel output weight
    ``[V/TP, h]`` against int targets ``[b, s]`` (global vocabulary ids): per-token losses
    ``[b, s]``, or with ``loss_mask`` ``[b, s]`` the scalar sum of loss x mask (the gradient
    then computed in the forward pass); the logits soft-capped at ``softcap`` when given."""
    gradients = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if group is None or not sequence_parallel:
        x = copy_to_region(x, group)
        return _OutputCrossEntropy.apply(x, weight, target, loss_mask, group, False, gradients, softcap)
    return _OutputCrossEntropy.apply(x, weight, target, loss_mask, group, True, gradients, softcap)
