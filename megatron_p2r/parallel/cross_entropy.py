"""Cross entropy over logits whose vocabulary is split across TP ranks.

The full-vocabulary logits never exist on one rank: each rank holds [N, V/TP], and the
max, the sum of exponentials and the target logit are combined with three all-reduces of
[N] tensors. Computed in fp32 after subtracting the max (numerically stable). With TP=1 it
is ``torch.nn.functional.cross_entropy``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local_v = logits.shape[-1]
        start = dist.get_rank(group) * local_v
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= local_v)
        local_target = local_target.masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)

        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss [...] for logits [..., V/TP] and int targets [...] (global vocab ids)."""
    if group is None:
        shape = target.shape
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="none").view(shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group)
