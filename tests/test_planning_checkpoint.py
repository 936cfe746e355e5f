"""The planner's checkpoint bytes per rank are what a real save writes: DP2 (dense, and MoE with
EP2), fully parallel and with one writer, with and without the distributed optimizer (file sizes
without their safetensors headers; the RNG files are not counted)."""
from __future__ import annotations

import os
import re
import struct

import pytest

from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.planning.checkpoint_cost import rank_bytes
from megatron_p2r.testing import run_distributed
from tests.checkpoint.common import cfg_of
from tests.checkpoint.cost_workers import save_both_ways

MOE = dict(num_layers=4, num_experts=4, moe_layer_freq=2, moe_ffn_hidden_size=24, expert_model_parallel_size=2)
CASES = {"distopt": dict(use_distributed_optimizer=True), "replicated": {},
         "moe-ep2-distopt": dict(MOE, use_distributed_optimizer=True), "moe-ep2": MOE}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cost"))
    run_distributed(save_both_ways, 2, root, CASES)
    return root


def _layout(cfg) -> Layout:
    return Layout(dp=2, ep=cfg.parallel.expert_model_parallel_size)


def written_by_rank(path: str) -> dict:
    """rank -> tensor bytes it wrote: a part file names its rank, a whole shard its writer (TP 1,
    PP 1: EP file E is written by DP rank E)."""
    iter_dir = resolve_iteration_dir(path)
    out: dict = {}
    for name in os.listdir(iter_dir):
        if not name.endswith(".safetensors"):
            continue
        part = re.search(r"\.rank_(\d+)\.safetensors$", name)
        rank = int(part.group(1)) if part else int(re.fullmatch(r"mp_rank_00_000_(\d+)\.safetensors", name).group(1))
        with open(os.path.join(iter_dir, name), "rb") as fh:
            header = struct.unpack("<Q", fh.read(8))[0]
        out[rank] = out.get(rank, 0) + os.path.getsize(os.path.join(iter_dir, name)) - 8 - header
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_single_writer_bytes_equal_the_planners(saved, case):
    cfg = cfg_of(global_batch_size=8, ckpt_fully_parallel_save=False, **CASES[case])
    planned = {r: round(b) for r, (b, _) in rank_bytes(cfg, _layout(cfg)).items()}
    assert written_by_rank(os.path.join(saved, case, "single")) == planned


@pytest.mark.parametrize("case", list(CASES))
def test_fully_parallel_bytes_equal_the_planners(saved, case):
    cfg = cfg_of(global_batch_size=8, **CASES[case])
    planned = {r: b for r, (b, _) in rank_bytes(cfg, _layout(cfg)).items()}
    written = written_by_rank(os.path.join(saved, case, "par"))
    assert set(written) == set(planned) == {0, 1}
    assert sum(written.values()) == round(sum(planned.values()))
    if "distopt" not in case:   # whole pieces, assigned as the save assigns them: exact
        assert written == {r: round(b) for r, b in planned.items()}
    else:                      # 1/DP of the shard each: off by bucket padding and the step counts only
        for r, b in written.items():
            assert abs(b - planned[r]) <= 0.02 * planned[r], (r, b, planned[r])
