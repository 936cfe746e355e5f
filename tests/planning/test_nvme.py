"""The planner's third memory tier, local NVMe (--cpu-offload-optimizer-nvme-path): the bytes it
moves off the host are the bytes training puts in the file, the host keeps the page cache of two
layers, the verdict names the NVMe tier when it overflows, and the host step streams the state at
--nvme-bw, each layer's disk traffic overlapping the step of the layer before."""

from __future__ import annotations

import json

import pytest

from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning import estimate, memory
from megatron_p2r.planning.hardware import GPU_PRESETS, NVME_PRESETS
from tests.helpers import run_steps, tiny_config
from tools.plan import main
from tests.planning.plan_argv import OFFLOADED

BASE = dict(num_layers=4, global_batch_size=4, cpu_offload_layers="0,2", bf16=True)
SMALL = OFFLOADED + ["--cpu-offload-optimizer-nvme-path", "/local/nvme"]


@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_planned_nvme_bytes_are_what_training_moves(tmp_path, optimizer):
    cfg = tiny_config(**BASE, optimizer=optimizer, cpu_offload_optimizer_nvme_path=str(tmp_path))
    ps = ParallelState.single()
    seed_everything(cfg.train.seed, 0, 0, ps.device)
    _, state = run_steps(cfg, ps, 1)
    opt, file = state.optimizer, state.offload.nvme.file
    host = [ms for ms in opt.shards if ms.placement == "host"]
    moved = sum(ms.main.numel() * 4 for ms in host if file.holds(ms.main)) + sum(
        v.numel() * v.element_size()
        for ms in host
        for k, v in opt.inner["host"].state[ms.main].items()
        if k != "step" and file.holds(v)
    )
    plan = ParallelPlan.build(cfg, Layout())
    off, ram = (
        memory.offload_plan(cfg, plan, 0),
        memory.offload_plan(cfg.replace(cpu_offload_optimizer_nvme_path=None), plan, 0),
    )
    per_layer = plan.module_state_bytes(0)
    assert off["nvme"] == moved == ram["host"]["optimizer"] > 0
    assert off["host"]["optimizer"] == 0
    assert off["host"]["nvme_window"] == 2 * max(per_layer[k]["optimizer"] for k in (0, 2))
    assert {k: v for k, v in off["host"].items() if k not in ("optimizer", "nvme_window")} == {
        k: v for k, v in ram["host"].items() if k != "optimizer"
    }
    report = state.offload.describe()  # what the rank logs at start
    assert report["host"] == off["host"] and report["nvme"] == off["nvme"] and report["device"] == off["device"]


def test_host_step_overlaps_each_layers_disk_traffic_with_the_step_before():
    """4 layers: stepping bound (1 s a layer, 0.5 s of disk): the first read (0.25 s) + 4 s; disk
    bound (2 s of disk a layer): 1 s + 8 s."""
    assert estimate.nvme_step_time(4.0, 4 * 10**9, 4, 4e9) == 0.25 + 4.0
    assert estimate.nvme_step_time(4.0, 16 * 10**9, 4, 4e9) == 1.0 + 8.0


def _plan(argv, capsys) -> tuple:
    status = main(argv + ["--json"])
    return status, json.loads(capsys.readouterr().out)["plans"]["real"]


def test_the_nvme_tier_is_checked_and_named(capsys):
    status, real = _plan(SMALL, capsys)
    nvme = real["tiers"]["nvme"]
    assert status == 0 and nvme["fits"] and nvme["capacity"] == NVME_PRESETS["V100-32GB"].per_node
    # 12 ranks, stages alternate every 6: node 0 holds ranks 0-7 (6 of stage 0, 2 of stage 1)
    by_stage = [st["nvme"] for st in real["stages"]]
    assert nvme["need"] == 6 * by_stage[0] + 2 * by_stage[1] and nvme["where"] == "node 0 (ranks 0-7)"
    assert real["nvme"] == {"per_node": NVME_PRESETS["V100-32GB"].per_node, "bw": 1.25e9}
    status, real = _plan(SMALL + ["--nvme-per-node", str(nvme["need"] - 1)], capsys)
    assert status == 1 and not real["tiers"]["nvme"]["fits"] and real["tiers"]["nvme"]["over"] == 1
    assert main(SMALL + ["--nvme-per-node", str(nvme["need"] - 1)]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: NVMe overflows by 0.00 GiB: node 0 (ranks 0-7) needs" in out
    assert "does not fit on NVMe: node 0 (ranks 0-7) keeps" in out and "(--nvme-per-node sets it)" in out


def test_nvme_bw_sets_the_host_step(capsys):
    """A fast disk leaves the step from RAM; that step is slower than without the path: the
    DRAM carries the disk's reads and writes too (planning/host_step.py)."""
    slow, fast = (_plan(SMALL + ["--nvme-bw", bw], capsys)[1]["stages"][0]["time_s"] for bw in ("1e3", "1e12"))
    _, ram = _plan(SMALL[:-2], capsys)
    assert slow["host_optimizer_from_nvme"] > 1000 * fast["host_optimizer_from_nvme"]
    assert fast["host_optimizer_from_nvme"] == pytest.approx(fast["host_optimizer_from_ram"], rel=1e-2)
    assert fast["host_optimizer_from_ram"] > ram["stages"][0]["time_s"]["host_optimizer_step"]


def test_without_the_flag_the_plan_has_no_nvme(capsys):
    _, real = _plan(SMALL[:-2], capsys)
    assert "nvme" not in real and "nvme" not in real["tiers"] and all("nvme" not in st for st in real["stages"])
    assert "nvme_window" not in real["stages"][0]["host"]


@pytest.mark.parametrize("flag", ["--nvme-bw", "--nvme-per-node"])
def test_nvme_figures_must_be_positive(flag, capsys):
    assert main(SMALL + [flag, "0"]) == 2
    assert f"{flag} must be" in capsys.readouterr().err


def test_every_preset_has_its_nodes_nvme():
    assert set(NVME_PRESETS) == set(GPU_PRESETS)


def test_the_10t_lines_the_docs_quote_are_what_the_planner_prints(capsys):
    """docs/scale.md quotes the real phase at 96 GiB per GPU with the state on NVMe
    (examples/m6_10t/README.md's verdict: tests/tools/test_plan_host.py)."""
    argv = [
        "--config",
        "examples/m6_10t/model.yaml",
        "--pseudo-config",
        "examples/m6_10t/pseudo.yaml",
        "--real-config",
        "examples/m6_10t/real_lean.yaml",
        "--world-size",
        "512",
        "--gpu",
        "V100-32GB",
        "--token-budget",
        "50B",
        "--host-memory",
        "96GiB",
        "--cpu-offload-optimizer-nvme-path",
        "/local/nvme",
    ]
    assert main(argv) == 1
    printed = capsys.readouterr().out.splitlines()
    with open("docs/scale.md", encoding="utf-8") as fh:
        scale = fh.read()
    quoted = scale[scale.index("**At 96 GiB of host per GPU") :].split("```")[1].strip("\n").splitlines()
    assert len(quoted) == 3 and all(line in printed for line in quoted)
