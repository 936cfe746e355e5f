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


def test_cp_ranks_share_the_default_stream_and_draw_their_own_model_parallel_masks():
    without_cp = _draws(tp_rank=0, pp_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(_draws(tp_rank=0, pp_rank=0, cp_rank=0), without_cp, strict=True))
    draws = [_draws(tp_rank=t, pp_rank=0, cp_rank=c) for c in range(4) for t in range(2)]
    defaults = {tuple(d.tolist()) for d, _ in draws}
    model_parallel = {tuple(m.tolist()) for _, m in draws}
    # the residual dropout's stream: the one-process run's on every rank (context.dropout slices it)
    assert defaults == {tuple(without_cp[0].tolist())}
    assert len(model_parallel) == 8  # one model-parallel stream per (TP, CP) rank
