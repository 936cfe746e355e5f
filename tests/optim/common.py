"""Helpers of the optimizer/DDP tests (importable by spawned ranks)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import expected_shard, reference_config, tiny_config

# Every case: the distributed optimizer with and without overlap, small buckets so a stage has
# several (the tiny model has ~33k parameters per rank).
DISTOPT = dict(use_distributed_optimizer=True)
OVERLAP = dict(
    use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=1500
)


def one_process(cfg):
    """The one-process reference of ``cfg``: no TP/PP/EP/DP, a plain (non-distributed) optimizer."""
    return reference_config(cfg).replace(
        use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False
    )


def weight_error(state, ref_state, ps: ParallelState) -> float:
    """Largest |weight - its slice of the reference weight| over this rank's parameters."""
    state.ddp.finish_param_sync()
    ref = dict(ref_state.model.named_parameters())
    return max(
        (p.detach().float() - expected_shard(ref[logical_name(n, p)].detach().float(), p, ps)).abs().max().item()
        for n, p in state.model.named_parameters()
    )


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """torch's fake process group in this process (collectives do nothing): any rank of a layout
    builds its real tensors here, for accounting and for hooks that do not need the data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cfg(**kw):
    return tiny_config(**{"global_batch_size": 8, **kw})
