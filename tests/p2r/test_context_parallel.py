"""Delinking and growth across context-parallel layouts: the checkpoint carries no CP, so a pseudo
model trained under CP2 delinks into a TP2 real run (and TP2 into CP2) with its function kept,
and a model trained under CP2, grown, continues alike under CP2 and on one process."""

import os

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import GrowOptions, Target, convert
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import setup_parallel
from tests.harness import run_distributed
from tests.helpers import reference_config, run_steps, tiny_config
from tests.p2r.test_delink import _across_layouts

CASES = {
    # name: (model, pseudo layout, real layout); 2 ranks each
    "cp2->tp2": ({}, dict(context_parallel_size=2), dict(tensor_model_parallel_size=2)),
    "tp2->cp2": ({}, dict(tensor_model_parallel_size=2), dict(context_parallel_size=2, tensor_model_parallel_size=1)),
}


def test_delink_across_cp_layouts_preserves_the_function_and_trains_like_one_process(tmp_path):
    """As tests/p2r/test_delink.py's layouts: eval loss kept (rel 1e-5), the first continued
    step's loss equal to the pseudo run's next, 2 real steps equal to one process's from the same
    delinked state, every weight within 2e-5."""
    for rank, res in enumerate(run_distributed(_across_layouts, 2, str(tmp_path), CASES)):
        for name in CASES:
            pseudo_eval, real_eval, pseudo_next, real_next, one_next, weight_err = res[name]
            assert real_eval == pytest.approx(pseudo_eval, rel=1e-5), name
            assert real_next[0] == pytest.approx(pseudo_next[0], rel=1e-5), name
            assert real_next == pytest.approx(one_next, rel=1e-5), (name, real_next, one_next)
            assert weight_err <= 2e-5, (name, rank, weight_err)


SOURCE = dict(num_layers=2, seq_length=16, global_batch_size=4, position_embedding_type="rope")


def _cp2(rank, world, save, load, num_layers):
    cfg = tiny_config(**{**SOURCE, "num_layers": num_layers}, context_parallel_size=2)
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    losses, state = run_steps(cfg, ps, 2, load=load)
    if save:
        save_checkpoint(save, state)
    return losses


def test_a_model_trained_under_cp2_grows_and_continues_alike_under_cp2_and_one_process(tmp_path):
    src, grown = str(tmp_path / "cp2"), str(tmp_path / "grown")
    run_distributed(_cp2, 2, src, None, 2)
    convert(src, grown, Target(1, 1), GrowOptions(num_layers=4, method="stack"), progress=False)
    assert os.path.isdir(grown)
    cp2 = run_distributed(_cp2, 2, None, grown, 4)
    one = reference_config(tiny_config(**{**SOURCE, "num_layers": 4}))
    one_losses, _ = run_steps(one, ParallelState.single(), 2, load=grown)
    for losses in cp2:
        assert losses == pytest.approx(one_losses, rel=1e-5), (losses, one_losses)
