"""RNG streams per context-parallel rank (parallel/random.py): the CP ranks of a sequence hold
different tokens, so they must not draw the same dropout masks; CP rank 0 keeps the streams of a
run without CP."""

import torch

from megatron_p2r.parallel.random import get_rng_tracker, seed_everything

CPU = torch.device("cpu")


def _draws(**ranks):
    seed_everything(1234, device=CPU, **ranks)
    default = torch.rand(8)
    with get_rng_tracker(CPU).fork():
        model_parallel = torch.rand(8)
    return default, model_parallel


def test_each_cp_rank_draws_its_own_masks_and_cp_rank_0_is_the_one_process_run():
    without_cp = _draws(tp_rank=0, pp_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(_draws(tp_rank=0, pp_rank=0, cp_rank=0), without_cp, strict=True))
    draws = [_draws(tp_rank=t, pp_rank=0, cp_rank=c) for c in range(4) for t in range(2)]
    defaults = {tuple(d.tolist()) for d, _ in draws}
    model_parallel = {tuple(m.tolist()) for _, m in draws}
    assert len(defaults) == 4  # one default stream per CP rank, shared by its TP ranks
    assert len(model_parallel) == 8  # one model-parallel stream per (TP, CP) rank
