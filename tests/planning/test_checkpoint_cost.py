"""The planner's checkpoint bytes per rank are what a real save writes: DP2 (dense, and MoE with
EP2), fully parallel and with one writer, with and without the distributed optimizer (file sizes
without their safetensors headers; the RNG files are not counted); and its host bytes of
``--async-save``'s copy are what that copy holds (tensor accounting)."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest

from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.planning.checkpoint_cost import async_save_host_bytes, rank_bytes
from tests.harness import run_distributed
from tests.checkpoint.common import cfg_of
from tests.checkpoint.cost_workers import save_both_ways
from tools.plan import main
from tests.planning.plan_argv import SHAPE

MOE = dict(num_layers=4, num_experts=4, moe_layer_freq=2, moe_ffn_hidden_size=24, expert_model_parallel_size=2)
CASES = {
    "distopt": dict(use_distributed_optimizer=True),
    "replicated": {},
    "moe-ep2-distopt": dict(MOE, use_distributed_optimizer=True),
    "moe-ep2": MOE,
    # Lion stores one moment per weight, Adafactor its two statistics broadcast to the weight's shape
    "lion-distopt": dict(optimizer="lion", use_distributed_optimizer=True),
    "adafactor": dict(optimizer="adafactor"),
    # 16-bit weights, fp32 mains and bf16 moments: the async host copy keeps each in its own dtype
    "moe-ep2-bf16-moments": dict(
        MOE, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"
    ),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cost"))
    return root, run_distributed(save_both_ways, 2, root, CASES)


@pytest.fixture(scope="module")
def saved(run):
    return run[0]


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
    if "distopt" not in case:  # whole pieces, assigned as the save assigns them: exact
        assert written == {r: round(b) for r, b in planned.items()}
    else:  # 1/DP of the shard each: off by bucket padding and the step counts only
        for r, b in written.items():
            assert abs(b - planned[r]) <= 0.02 * planned[r], (r, b, planned[r])


@pytest.mark.parametrize("case", list(CASES))
def test_the_async_copy_bytes_equal_the_planners(run, case):
    """Every rank's host copy (each storage it holds counted once) is the planner's figure:
    exactly where ranks own whole pieces (with EP2 x DP2, expert-DP 1: each rank all its experts),
    within the bucket padding under the distributed optimizer."""
    cfg = cfg_of(global_batch_size=8, async_save=True, **CASES[case])
    planned = async_save_host_bytes(cfg, _layout(cfg))
    copied = {r: out[case] for r, out in enumerate(run[1])}
    assert set(planned) == set(copied) == {0, 1}
    if "distopt" not in case:
        assert copied == {r: round(b) for r, b in planned.items()}
    else:
        assert sum(copied.values()) == round(sum(planned.values()))
        for r, b in copied.items():
            assert abs(b - planned[r]) <= 0.02 * planned[r], (r, b, planned[r])
    assert async_save_host_bytes(cfg_of(global_batch_size=8, **CASES[case]), _layout(cfg)) == {}


SMALL = SHAPE + ["--world-size", "16", "--gpus-per-node", "4", "--use-distributed-optimizer", "--gpu", "H100-80GB"]


def _checkpoint(capsys, argv) -> dict:
    assert main(SMALL + argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)["plans"]["real"]["checkpoint"]


def test_write_time_follows_the_bandwidth_that_binds(capsys):
    wide = _checkpoint(capsys, ["--fs-write-bw", "1e6", "--fs-node-write-bw", "1e12"])
    assert wide["write_s"] == wide["total_bytes"] / 1e6 == wide["stall_s"]["sync"]
    narrow = _checkpoint(capsys, ["--fs-write-bw", "1e12", "--fs-node-write-bw", "1e3"])
    assert narrow["write_s"] == narrow["node_bytes_max"] / 1e3
    # 16 ranks, 4 per node, every rank writes 1/16: a node writes 4 ranks' share
    assert narrow["writing_ranks"] == 16 and narrow["nodes"] == 4
    assert narrow["node_bytes_max"] == pytest.approx(narrow["total_bytes"] / 4, rel=1e-6)
    single = _checkpoint(capsys, ["--no-ckpt-fully-parallel-save"])
    assert single["writers"] == "single_writer" and single["writing_ranks"] == 1
    assert single["host_bytes_during_save"]["sync"] == single["rank_bytes_max"] == single["total_bytes"]


def test_async_stall_is_the_copy_to_host(capsys):
    c = _checkpoint(capsys, ["--host-bw", "1e9"])
    host = c["host_bytes_during_save"]  # fp32 state: the host copy is what the rank writes
    assert c["stall_s"]["async"] == c["rank_bytes_max"] / 1e9
    assert host["async"] == host["sync"] + c["rank_bytes_max"]


def test_text_output_and_bad_bandwidth(capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "checkpoint " in out and "every rank writes what it owns, 16 ranks" in out and "--async-save" in out
    assert main(SMALL + ["--fs-write-bw", "0"]) == 2
    assert "error: --fs-write-bw must be" in capsys.readouterr().err
