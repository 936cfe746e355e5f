"""The output layer and the cross entropy, fused and chunked over tokens, vocabulary split over TP.

Full logits never exist: neither the whole vocabulary on one rank (each rank holds its
``[V/TP, h]`` slice of the output weight) nor all tokens at once. ``output_cross_entropy``
walks the tokens in chunks of about ``CHUNK_ELEMENTS / (V/TP)``: per chunk it computes the
logits ``x_c W^T`` (in the compute dtype: bf16 logits under bf16 autocast), takes their
log-sum-exp and target logit in fp32, and frees them. The TP ranks' partial log-sum-exps and
target logits are combined with one all-gather of ``[N, 2]`` per micro-batch. Backward walks
the chunks again: it recomputes the chunk's logits (one more ``N x h x V/TP`` matmul, the
price of never holding them), forms ``softmax - onehot`` times the incoming per-token gradient
and accumulates the gradients of the input and the weight. Saved for backward: the input
(a sequence shard under sequence parallelism, gathered again in backward), the per-token
log-sum-exp and the targets -- O(N) besides the input, O(chunk x V/TP) at any moment.

Per-token losses come out, so any loss mask or reduction applies downstream (the schedules
sum ``loss x mask``). fp32 throughout without autocast (``tests/parallel/test_cross_entropy.py``
compares with a float64 reference on a padded vocabulary, TP 1/2/4).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_p2r.parallel.mappings import all_gather_sequence, copy_to_region, reduce_scatter_sequence

CHUNK_ELEMENTS = 1 << 20   # logits per chunk (4 MiB in fp32): fits a core's cache with its inputs


def _chunk_tokens(local_vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // local_vocab)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _target_logit(logits: torch.Tensor, local_target: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, local_target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~inside, 0.0)


class _OutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, gather_sequence):
        ctx.x_dtype, dtype = x.dtype, _compute_dtype(x)
        x = x.to(dtype)   # what is gathered and saved: the compute dtype's bytes
        with torch.autocast(x.device.type, enabled=False):
            full = all_gather_sequence(x, group) if gather_sequence else x
            inputs, w = full.reshape(-1, full.shape[-1]), weight.to(dtype)
            local_target = target.reshape(-1) - (dist.get_rank(group) * w.shape[0] if group is not None else 0)
            inside = (local_target >= 0) & (local_target < w.shape[0])
            stats = inputs.new_empty((inputs.shape[0], 2), dtype=torch.float32)   # log-sum-exp, target logit
            step = _chunk_tokens(w.shape[0])
            for start in range(0, inputs.shape[0], step):
                rows = slice(start, start + step)
                logits = (inputs[rows] @ w.t()).float()
                stats[rows, 0] = torch.logsumexp(logits, dim=-1)
                stats[rows, 1] = _target_logit(logits, local_target[rows], inside[rows])
            if group is not None:   # combine the vocabulary shards: logsumexp of the parts, sum of the targets
                parts = stats.new_empty((dist.get_world_size(group) * stats.shape[0], 2))
                dist.all_gather_single(parts, stats, group=group)
                parts = parts.view(-1, *stats.shape)
                stats = torch.stack([torch.logsumexp(parts[..., 0], dim=0), parts[..., 1].sum(0)], dim=-1)
        ctx.save_for_backward(x, weight, local_target, inside, stats[:, 0].contiguous())
        ctx.group, ctx.gather_sequence, ctx.dtype = group, gather_sequence, dtype
        return (stats[:, 0] - stats[:, 1]).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, local_target, inside, lse = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group) if ctx.gather_sequence else x
        inputs, w = full.reshape(-1, full.shape[-1]), weight.to(ctx.dtype)
        grad_loss = grad_loss.reshape(-1).float()
        grad_inputs = torch.empty_like(inputs)
        grad_w = torch.zeros_like(weight)
        step = _chunk_tokens(w.shape[0])
        for start in range(0, inputs.shape[0], step):
            rows = slice(start, start + step)
            probs = (inputs[rows] @ w.t()).float().sub_(lse[rows].unsqueeze(-1)).exp_()
            hit = inside[rows].nonzero().squeeze(-1)
            probs[hit, local_target[rows][hit]] -= 1.0
            d = probs.mul_(grad_loss[rows].unsqueeze(-1)).to(ctx.dtype)
            torch.mm(d, w, out=grad_inputs[rows])
            grad_w.add_(d.t() @ inputs[rows])
        grad_x = grad_inputs.view(full.shape)
        if ctx.gather_sequence:
            grad_x = reduce_scatter_sequence(grad_x, ctx.group)
        return grad_x.to(ctx.x_dtype), grad_w, None, None, None


def output_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         group: Optional[dist.ProcessGroup], sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of hidden states ``x`` (``[b, s, h]``, or this rank's sequence
    shard ``[b, s/TP, h]`` under sequence parallelism) through the vocabulary-parallel output
    weight ``[V/TP, h]`` against int targets ``[b, s]`` (global vocabulary ids)."""
    if group is None or not sequence_parallel:
        return _OutputCrossEntropy.apply(copy_to_region(x, group), weight, target, group, False)
    return _OutputCrossEntropy.apply(x, weight, target, group, True)
