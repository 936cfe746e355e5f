"""Checkpoints stay layout-free under context parallelism: a CP2 (and CP4) run's checkpoint (its
optimizer state sharded over DP x CP) resumes on one process (CP1) and a CP1 checkpoint resumes
under CP2 (CP4), each continuing the uninterrupted one-process
run (fp32: the next step's loss rel 1e-5, the weights after it abs 1e-3 as in
tests/context/test_equivalence.py: only the order of the CP sums differs)."""

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import setup_parallel
from tests.context.test_equivalence import BASE
from tests.harness import run_distributed
from tests.helpers import reference_config, run_steps, tiny_config

# the distributed optimizer: each CP rank writes the optimizer state of its shard (over DP x CP)
CP2 = tiny_config(**BASE, context_parallel_size=2, use_distributed_optimizer=True)


def _cp(rank, world, save, load):
    cfg = CP2.replace(context_parallel_size=world)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    losses, state = run_steps(cfg, ps, 2 if save else 1, load=load)
    if save:
        save_checkpoint(save, state)
    return losses, {n: p.detach().numpy().copy() for n, p in state.model.named_parameters()}  # by value


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_resumes_under_cp1_and_cp1_under_cp(tmp_path, cp):
    one = reference_config(CP2)
    want, uninterrupted = run_steps(one, ParallelState.single(), 3)
    reference = dict(uninterrupted.model.named_parameters())

    run_distributed(_cp, cp, str(tmp_path / "cp2"), None)
    resumed_cp1, state = run_steps(one, ParallelState.single(), 1, load=str(tmp_path / "cp2"))
    assert abs(resumed_cp1[0] - want[2]) < 1e-5 * want[2]
    for n, p in state.model.named_parameters():
        assert (p.detach() - reference[n].detach()).abs().max() < 1e-3, n

    _, cp1_state = run_steps(one, ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "cp1"), cp1_state)
    for losses, params in run_distributed(_cp, cp, None, str(tmp_path / "cp1")):
        assert abs(losses[0] - want[2]) < 1e-5 * want[2]
        for n, p in params.items():  # CP ranks hold whole weights
            assert (torch.from_numpy(p) - reference[n].detach()).abs().max() < 1e-3, n
