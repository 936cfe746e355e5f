"""The host optimizer step's time model (planning/host_step.py): bytes per element from the
kernels' traffic contract, min(threads x one thread's rate, the node's DRAM shared with the
offload copies), the node figures of each preset with their sources, a user's own host from
``benchmarks/host_optimizer.py --json`` (--host-calibration), and what the plan says about them."""

from __future__ import annotations

import json

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.optim import host_kernels
from megatron_p2r.optim.traffic import kernel_bytes_per_element
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.planning.estimate import make_plan, step_bytes_per_element
from megatron_p2r.planning.hardware import GPU_HOSTS, GPU_PRESETS, HOST_PRESETS, SUSTAINED_FRACTION, HostSpec
from megatron_p2r.planning.host_step import host_bandwidth, load_calibration, threads_per_rank
from megatron_p2r.training import build_train_state, train_step
from tools.plan import check, main
from tests.helpers import random_microbatches, tiny_config
from tests.planning.plan_argv import OFFLOADED

CALIBRATION = "tests/fixtures/host_calibration.json"
ADAM_FP16 = ("adam", "fp32", "fp32", (("exp_avg", "fp32"), ("exp_avg_sq", "fp32")), "fp16")
SMALL = OFFLOADED
DELAYED = ["--overlap-cpu-optimizer-d2h-h2d", "--cpu-offload-delayed-param-update"]


def plan_json(argv, capsys) -> tuple:
    status = main(argv + ["--json"])
    return status, json.loads(capsys.readouterr().out)


def test_calibration_round_trip():
    """The benchmark's JSON -> the plan's inputs: cores, the all-threads triad as the DRAM
    bandwidth, the 1-thread triad as one thread's fallback rate, and per setting one thread's
    rate from its 1-thread row (bytes per element / ns per element); the 16-thread row is not one."""
    host = load_calibration(CALIBRATION)
    assert (host.cores, host.dram_bw, host.thread_bw) == (16, 96e9, 12e9)
    assert host.setting_bw == {
        ADAM_FP16: pytest.approx(30 / 3.0e-9),
        ("adafactor", "fp32", "bf16", (), "fp16"): pytest.approx(16 / 4.0e-9),
    }
    assert all(source.startswith("measured: ") for source in host.sources.values())


def test_a_kernel_faster_than_the_triad_sets_the_dram_bandwidth(tmp_path):
    """A triad written in torch streams slower than the best kernel on some hosts (this 2-core VM:
    41 GB/s against fused AdamW's 57 GB/s at one thread); the DRAM is at least what was streamed."""
    with open(CALIBRATION, encoding="utf-8") as fh:
        data = json.load(fh)
    row = dict(data["results"][0], threads=16, ns_per_element=0.06)  # 30 B per element at 500 GB/s
    data["results"].append(row)
    path = tmp_path / "fast.json"
    path.write_text(json.dumps(data))
    host = load_calibration(str(path))
    assert host.dram_bw == pytest.approx(500e9)
    assert "fastest kernel" in host.sources["dram_bw"]


def test_the_plan_reads_the_calibration(capsys):
    one_thread = ["--host-calibration", CALIBRATION, "--host-optimizer-threads", "1"]
    status, out = plan_json(SMALL + one_thread, capsys)
    h = out["plans"]["real"]["stages"][0]["host_step"]
    assert status == 0 and h["thread_bw"] == pytest.approx(10e9) and h["dram_bw"] == 96e9 and h["cores"] == 16
    assert h["thread_bw_source"].startswith("measured: ") and h["dram_bw_source"].startswith("measured: ")
    assert h["threads"] == 1 and h["limit"] == "threads" and h["bw"] == pytest.approx(10e9)
    main(SMALL + one_thread)
    text = capsys.readouterr().out
    assert "at 10 GB/s per GPU = min(1 threads x 10 GB/s, DRAM 96 GB/s / 8 GPUs" in text
    assert "per thread: measured: tests/fixtures/host_calibration.json, its 1-thread row" in text


@pytest.mark.parametrize(
    "content,says",
    [
        ("{", "not JSON"),
        ('{"triad_gbs": {"1": 10}}', "'cores' missing"),
        ('{"cores": 8, "triad_gbs": {"8": 10}}', "needs the 1-thread triad"),
        ('{"cores": 8, "triad_gbs": {"1": 0}}', "'triad_gbs.1' must be a positive number"),
        (
            '{"cores": 8, "triad_gbs": {"1": 5}, "results": [{"optimizer": "sgd", "threads": 1}]}',
            "'results[0].optimizer' must be adam, lion or adafactor",
        ),
    ],
)
def test_a_bad_calibration_is_one_error_line(tmp_path, capsys, content, says):
    path = tmp_path / "host.json"
    path.write_text(content)
    assert main(SMALL + ["--host-calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --host-calibration {path}: ") and says in err and "Traceback" not in err


def test_bandwidth_by_hand():
    """min(threads x rate, the DRAM's share left by the other traffic): 4 x 2 GB/s = 8 GB/s
    against 80 GB/s / 8 ranks = 10 GB/s alone, 5 GB/s when the copies move as many bytes."""
    host = HostSpec("h", cores=32, dram_bw=80e9, thread_bw=2e9)
    got = host_bandwidth(ADAM_FP16, host, (4.0, "why"), 8, step_bytes=300.0, other_bytes=0.0)
    assert (got["bw"], got["limit"], got["dram_share"]) == (8e9, "threads", 10e9)
    got = host_bandwidth(ADAM_FP16, host, (4.0, "why"), 8, step_bytes=300.0, other_bytes=300.0)
    assert (got["bw"], got["limit"]) == (5e9, "dram")
    assert host_bandwidth(ADAM_FP16, host, (4.0, "why"), 8, 300.0, 300.0, given_bw=1e9)["bw"] == 1e9


def test_threads_per_rank():
    host = HostSpec("h", cores=40, dram_bw=1.0, thread_bw=1.0)
    assert threads_per_rank("auto", host, 8)[0] == 5 and threads_per_rank(None, host, 16)[0] == 2.5
    assert threads_per_rank(3, host, 8) == (3.0, "--host-optimizer-threads 3")
    assert threads_per_rank(16, host, 8)[0] == 5  # no more than the rank's cores


@pytest.mark.parametrize(
    "flags,args",
    [
        ([], ("adam", "fp32", "fp32", {"a": "fp32", "b": "fp32"}, None)),
        (["--fp16"], ("adam", "fp32", "fp32", {"a": "fp32", "b": "fp32"}, "fp16")),
        (
            ["--bf16", "--optimizer", "adafactor", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
            ("adafactor", "fp32", "bf16", {}, "bf16"),
        ),
        (
            ["--bf16", "--optimizer", "lion", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
            ("lion", "fp32", "fp32", {"a": "bf16"}, "bf16"),
        ),
        (
            ["--fp16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"],
            ("adam", "fp16", "fp32", {"a": "fp32", "b": "fp16"}, None),
        ),
    ],
)
def test_bytes_per_element_are_the_kernels(flags, args):
    cfg = parse_args(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--vocab-size",
            "256",
            *flags,
        ]
    )
    assert step_bytes_per_element(cfg, ParallelPlan.for_world(cfg, 1)) == kernel_bytes_per_element(*args)


def test_presets_have_sources():
    """Every GPU preset has a node; each node's cores and DRAM are sourced, its sustained fraction
    and per-thread rate marked assumed."""
    assert set(GPU_HOSTS) == set(GPU_PRESETS) and set(GPU_HOSTS.values()) <= set(HOST_PRESETS)
    for host in HOST_PRESETS.values():
        assert host.sources["cores"].startswith("sourced: ") and str(host.cores // 2) in host.sources["cores"]
        assert (
            host.sources["dram_bw"].startswith("assumed: ")
            and f"{host.dram_peak / 1e9:.1f} GB/s" in host.sources["dram_bw"]
        )
        assert host.sources["thread_bw"].startswith("assumed: ")
        assert host.dram_bw == pytest.approx(host.dram_peak * SUSTAINED_FRACTION)
    assert HOST_PRESETS["DGX-1V"].dram_peak == 2 * 4 * 2400e6 * 8 and HOST_PRESETS["DGX-1V"].cores == 40


def test_given_figures_override_and_say_so(capsys):
    _, out = plan_json(
        SMALL + ["--host-calibration", CALIBRATION, "--host-thread-bw", "1e9", "--host-cores", "8"], capsys
    )
    h = out["plans"]["real"]["stages"][0]["host_step"]
    assert (h["thread_bw"], h["cores"], h["dram_bw"]) == (1e9, 8, 96e9)
    assert h["thread_bw_source"] == "given: --host-thread-bw" and h["dram_bw_source"].startswith("measured: ")
    assert main(SMALL + ["--host-calibration", CALIBRATION, "--host-node", "DGX-2"]) == 2
    assert "give it or --host-node, not both" in capsys.readouterr().err


def test_a_delayed_update_that_costs_time_warns_and_hides_nothing_negative(capsys):
    """A host step far longer than the iteration: the delay adds the weight write to it, so the
    plan warns and its hidden time is 0, not negative."""
    status, out = plan_json(SMALL + DELAYED + ["--host-optimizer-bw", "1e3"], capsys)
    real = out["plans"]["real"]
    assert real["warnings"] and all(
        "--cpu-offload-delayed-param-update makes the optimizer step" in w for w in real["warnings"]
    )
    for st in real["stages"]:
        t = st["time_s"]
        assert t["host_optimizer_hidden"] == 0.0 and t["host_optimizer_variant_cost"] > 0
    main(SMALL + DELAYED + ["--host-optimizer-bw", "1e3"])
    assert "   warning: stage 0: --cpu-offload-delayed-param-update makes" in capsys.readouterr().out
    _, out = plan_json(SMALL + DELAYED + ["--host-optimizer-bw", "1e14"], capsys)  # a fast host: no warning
    assert "warnings" not in out["plans"]["real"]
    assert all("host_optimizer_variant_cost" not in st["time_s"] for st in out["plans"]["real"]["stages"])


def test_device_memory_budget_on_the_command_line(capsys):
    """It reaches the phase that chooses its layers and is left out of the pseudo phase."""
    ten_t = [
        "--config",
        "examples/m6_10t/model.yaml",
        "--pseudo-config",
        "examples/m6_10t/pseudo.yaml",
        "--real-config",
        "examples/m6_10t/real.yaml",
        "--world-size",
        "512",
        "--gpu",
        "V100-32GB",
    ]
    _, base = plan_json(ten_t, capsys)
    status, more = plan_json(ten_t + ["--device-memory-budget", "24GiB"], capsys)
    assert status == 1 and more["plans"]["pseudo"] == base["plans"]["pseudo"]
    assert len(more["plans"]["real"]["stages"][0]["offloaded_layers"]) < len(
        base["plans"]["real"]["stages"][0]["offloaded_layers"]
    )
    with pytest.raises(ConfigError, match="--device-memory-budget is used only with --cpu-offload-layers auto"):
        check(parse_args(SMALL[:-6] + ["--device-memory-budget", "1GiB"]), 1)


def test_the_lines_docs_offload_quotes_are_what_the_planner_prints(capsys):
    """docs/offload.md quotes the 10T README command's host-step lines and the delayed update's."""
    ten_t = [
        "--config",
        "examples/m6_10t/model.yaml",
        "--pseudo-config",
        "examples/m6_10t/pseudo.yaml",
        "--world-size",
        "512",
        "--gpu",
        "V100-32GB",
        "--token-budget",
        "50B",
    ]
    main(ten_t + ["--real-config", "examples/m6_10t/real.yaml"])
    printed = set(capsys.readouterr().out.splitlines())
    main(
        ten_t
        + [
            "--real-config",
            "examples/m6_10t/real_lean.yaml",
            "--host-memory",
            "192GiB",
            "--use-precision-aware-optimizer",
            "--main-grads-dtype",
            "bf16",
            "--cpu-offload-delayed-param-update",
        ]
    )
    printed |= set(capsys.readouterr().out.splitlines())
    with open("docs/offload.md", encoding="utf-8") as fh:
        doc = fh.read().splitlines()
    quoted = [
        line
        for line in doc
        if line.startswith(
            ("   host step (", "     threads: ", "   step ", "   delayed parameter update (", "== Pseudo-to-Real")
        )
    ]
    assert len(quoted) >= 5 and [line for line in quoted if line not in printed] == []


def test_the_10t_delayed_update_on_h200_nodes_warns(capsys):
    """Issue 37's case (one host thread per rank, as it was measured): on H200 nodes the iteration
    is short, so the delayed step and its write outlast it and the delay costs more than it hides;
    the plan says so, and hides nothing negative."""
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
        "H200-141GB",
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "bf16",
        "--host-optimizer-threads",
        "1",
    ]
    _, delayed = plan_json(argv + ["--cpu-offload-delayed-param-update"], capsys)
    _, undelayed = plan_json(argv, capsys)
    d, u = delayed["plans"]["real"], undelayed["plans"]["real"]
    cost = d["stages"][0]["time_s"]["host_optimizer_variant_cost"]
    assert d["stages"][0]["time_s"]["optimizer"] == pytest.approx(u["stages"][0]["time_s"]["optimizer"] + cost)
    assert cost > 0 and d["stages"][0]["time_s"]["host_optimizer_hidden"] >= 0 and len(d["warnings"]) == 1
    assert "warnings" not in u


def test_an_overlap_that_costs_time_warns(capsys):
    """A DRAM-bound host step overlapped with the next forward shares the DRAM with its weight
    fetches; on a tiny model the forward hides far less than that costs."""
    _, out = plan_json(SMALL + ["--overlap-cpu-optimizer-d2h-h2d", "--host-dram-bw", "1e6"], capsys)
    _, serial = plan_json(SMALL + ["--host-dram-bw", "1e6"], capsys)
    real = out["plans"]["real"]
    assert all("--overlap-cpu-optimizer-d2h-h2d makes the optimizer step" in w for w in real["warnings"])
    for st, ser in zip(real["stages"], serial["plans"]["real"]["stages"], strict=True):
        t = st["time_s"]
        assert t["optimizer"] == pytest.approx(ser["time_s"]["optimizer"] + t["host_optimizer_variant_cost"])
        assert st["host_step"]["limit"] == "dram" and st["host_step"]["other_dram_bytes"] > 0


@pytest.mark.skipif(not host_kernels.available(), reason="no C++ compiler for the host kernels")
@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_the_host_step_runs_on_the_threads_the_planner_plans(optimizer):
    """An fp32 run offloading its layers with --host-optimizer-threads 2 (all-fp32 AdamW: torch's
    arithmetic, the host kernel's threads): the host step's kernel calls ran on 2 threads, by the
    kernels' own count (``peak_threads``, read around the host step only), and the planner plans 2."""
    c = tiny_config(hidden_size=256, ffn_hidden_size=1024, cpu_offload_layers="2", host_optimizer_threads="2")
    c = c.replace(optimizer=optimizer, global_batch_size=1, micro_batch_size=1)
    state = build_train_state(c, ParallelState.single())
    host, ran = state.optimizer.host, []
    submit = host.submit

    def counted(*args, **kwargs):
        host_kernels.peak_threads()
        submit(*args, **kwargs)
        ran.append(host_kernels.peak_threads())

    host.submit = counted
    try:
        train_step(state, random_microbatches(c, 1, 1))
    finally:
        host_kernels.set_threads(1)
    planned = make_plan(c, 1, GPU_PRESETS["V100-32GB"].with_node(gpus_per_node=1)).stages[0].host_step
    assert ran == [2] and planned["threads"] == 2
