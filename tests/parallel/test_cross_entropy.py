"""Vocab-parallel cross entropy equals torch's cross_entropy on padded vocabularies."""
import torch
import torch.nn.functional as F

from megatron_p2r.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_p2r.parallel.sharding import tp_slice
from megatron_p2r.parallel.state import Layout, initialize
from megatron_p2r.testing import run_distributed


def _check(rank, world):
    ps = initialize(Layout.from_world(world, tp=world), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64  # targets only in the real vocabulary, logits over the padded one
    logits = (torch.randn(6, 5, padded, generator=g) * 30).double()  # large values: stability
    target = torch.randint(0, vocab, (6, 5), generator=g)
    weights = torch.rand(6, 5, generator=g).double()
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, padded), target.reshape(-1), reduction="none").view(6, 5)
    (ref * weights).sum().backward()
    local = tp_slice(logits, -1, ps.tp_rank, ps.tp_size).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ps.group("tp"))
    (loss * weights).sum().backward()
    return ((loss - ref.detach()).abs().max().item(),
            (local.grad - tp_slice(full.grad, -1, ps.tp_rank, ps.tp_size)).abs().max().item())


def test_vocab_parallel_cross_entropy_matches_torch():
    for loss_err, grad_err in run_distributed(_check, 2):
        assert loss_err < 1e-10 and grad_err < 1e-10  # float64 inputs: exact up to rounding
