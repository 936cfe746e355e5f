"""The fused, chunked output layer + cross entropy against a float64 reference.

Hidden states x, an output weight over a padded vocabulary (targets only in the real
vocabulary, logits over the padded one) and a loss mask: the masked sum of the per-token
losses and its gradients for x and the weight equal float64 ``F.cross_entropy`` of ``x W^T``,
both ways the function offers it — per-token losses multiplied by the mask outside (gradients
by recomputation in backward), and the masked sum itself (gradients computed in the forward) —
for TP 1, 2 and 4, with x replicated or (sequence parallelism) a sequence shard, and with
chunks of 5 tokens, so the 24 tokens span 5 of them (the last one ragged).

Tolerances: fp32 inputs against the float64 reference, 1e-5 relative on the loss and 5e-6 on
the gradients (largest deviation over largest entry: fp32 rounding of sums over 24 tokens or
64 logits); bf16 autocast against float64 CE of the bf16 logits (the loss is taken in fp32
from bf16 logits), 2e-3 relative.
"""

import torch
import torch.nn.functional as F

from megatron_p2r.parallel import cross_entropy
from megatron_p2r.parallel.sharding import tp_slice
from megatron_p2r.parallel.state import Layout, ParallelState, initialize
from tests.harness import run_distributed

B, S, H, VOCAB, PADDED = 3, 8, 16, 50, 64


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 2.0  # large logits: the log-sum-exp must be stable
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    return x, weight, target, mask


def _reference(x, weight, target, mask):
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    loss = F.cross_entropy((x64 @ w64.t()).reshape(-1, PADDED), target.reshape(-1), reduction="none")
    total = (loss * mask.reshape(-1).double()).sum()
    total.backward()
    return total.detach(), x64.grad, w64.grad


def _errors(ps: ParallelState, sequence_parallel: bool, fused: bool) -> dict:
    """Relative errors (of the loss; of this rank's gradient slices, their largest deviation
    over their largest entry) in fp32, and of the bf16 loss."""
    x, weight, target, mask = _inputs()
    ref_total, ref_gx, ref_gw = _reference(x, weight, target, mask)
    group, tp, rank = ps.group("tp"), ps.tp_size, ps.tp_rank
    local_x = (tp_slice(x, 1, rank, tp) if sequence_parallel else x).clone().requires_grad_()
    local_w = tp_slice(weight, 0, rank, tp).clone().requires_grad_()

    def masked_sum():
        if fused:
            return cross_entropy.output_cross_entropy(local_x, local_w, target, group, sequence_parallel, mask)
        return (cross_entropy.output_cross_entropy(local_x, local_w, target, group, sequence_parallel) * mask).sum()

    total = masked_sum()
    (total * 3.0).backward()  # a scalar gradient other than 1
    want_gx = 3.0 * (tp_slice(ref_gx, 1, rank, tp) if sequence_parallel else ref_gx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = masked_sum()
    logits16 = (x.bfloat16() @ weight.bfloat16().t()).double()
    ref16 = (
        F.cross_entropy(logits16.reshape(-1, PADDED), target.reshape(-1), reduction="none") * mask.reshape(-1).double()
    ).sum()
    want_gw = 3.0 * tp_slice(ref_gw, 0, rank, tp)
    return {
        "loss": abs(total.item() / ref_total.item() - 1),
        "grad_x": ((local_x.grad.double() - want_gx).abs().max() / want_gx.abs().max()).item(),
        "grad_w": ((local_w.grad.double() - want_gw).abs().max() / want_gw.abs().max()).item(),
        "bf16_loss": abs(bf16.item() / ref16.item() - 1),
        "loss_dtype": str(bf16.dtype),
    }


def _cases(ps: ParallelState, modes=(False, True)) -> dict:
    return {(sp, fused): _errors(ps, sp, fused) for sp in modes for fused in (False, True)}


def _check_ranks(rank, world):
    cross_entropy.CHUNK_ELEMENTS = 5 * PADDED // world  # 5 tokens per chunk of this rank's vocabulary
    return _cases(initialize(Layout.from_world(world, tp=world), torch.device("cpu")))


def _assert_close(errors: dict, case) -> None:
    assert errors["loss"] < 1e-5 and errors["bf16_loss"] < 2e-3, (case, errors)
    assert errors["grad_x"] < 5e-6 and errors["grad_w"] < 5e-6, (case, errors)
    assert errors["loss_dtype"] == "torch.float32", (case, errors)


def test_chunked_cross_entropy_matches_float64_on_padded_vocab(monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 5 * PADDED)
    assert cross_entropy.chunk_tokens(PADDED) == 5
    for case, errors in _cases(ParallelState.single(), modes=(False,)).items():
        _assert_close(errors, ("tp1", case))
    for world in (2, 4):
        for rank, by_case in enumerate(run_distributed(_check_ranks, world)):
            for (sp, fused), errors in by_case.items():
                _assert_close(
                    errors,
                    (
                        f"tp{world}",
                        rank,
                        "sequence-parallel" if sp else "replicated",
                        "masked sum" if fused else "per token",
                    ),
                )
