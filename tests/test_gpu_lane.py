"""The GPU lane's machinery on CPU: the lane's whole trial on CPU (the CUDA tests' dry run and
every benchmark in its smallest shape, so a change that breaks the lane fails here), the trace
analysis the overlap test relies on, and the runner behind ``make gpu-check`` (time limits that
kill a whole process group, a failing step that does not stop the next, the report written
after each step and copied to $OUT)."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.cuda.trace import stream_overlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_lane_passes_its_trial_on_cpu(tmp_path):
    """``make gpu-check GPU_CHECK_ARGS=--dry-run-tests`` on CPU: every step passes in its order,
    every CUDA test runs up to the point where it needs CUDA (its skip says so; none skips
    whole) or says it needs 2 GPUs, every benchmark's figures reach the report and the printed
    summary, and ``--estimate`` reads the report back into the GPU schedule."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "P2R_CUDA_DRY_RUN")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU trial even on a GPU machine
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--out", str(out), "--dry-run-tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )  # a hang is killed with its process before pytest's 600 s limit
    report = json.loads((out / "report.json").read_text())
    gpu_check = load_gpu_check()
    absent = {"host_optimizer"} if not os.path.exists(os.path.join(ROOT, "benchmarks", "host_optimizer.py")) else set()
    not_passed = {
        s["name"]: s["log_tail"] for s in report["steps"] if s["status"] != "passed" and s["name"] not in absent
    }
    assert not not_passed and proc.returncode == 0, (not_passed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert [s["name"] for s in report["steps"]] == [p.name for p in gpu_check.STEPS]
    assert report["ok"] and report["mode"].startswith("cpu-trial")
    outcomes = {t["test"]: (t["outcome"], t["message"]) for t in report["tests"]}
    modules = {m.split(".")[-1] + ".py" for m in (t.split("::")[0] for t in outcomes)}
    assert modules == {m for p in gpu_check.STEPS for m in p.tests}, sorted(outcomes)
    assert not [
        (t, o)
        for t, o in outcomes.items()
        if o[0] != "passed" and not o[1].startswith(("dry run on CPU: ", "needs 2 CUDA GPUs"))
    ]
    assert sum(outcome == "passed" for outcome, _ in outcomes.values()) >= 15, outcomes
    for title in (
        "## MFU (benchmarks/mfu.py)",
        "## Offload (benchmarks/offload.py, shape micro",
        "## Step throughput (benchmarks/step_throughput.py)",
        *(() if absent else ("## Host optimizer step (benchmarks/host_optimizer.py",)),
    ):
        assert title in proc.stdout, proc.stdout[-3000:]
    assert "gpu-check: ok (passed: environment, train," in proc.stdout, proc.stdout[-500:]
    rows = gpu_check.estimate(report)
    assert [r["step"] for r in rows] == [p.name for p in gpu_check.STEPS]
    assert all(r["dry_run_s"] is not None for r in rows)


def test_the_planned_schedule_fits_the_budget_in_user_order():
    """The limits (what the lane enforces) add up to at most 12 of a lend's 15 minutes; bf16
    training comes first, then offload, checkpoints, MoE; the speed figures last."""
    gpu_check = load_gpu_check()
    assert sum(p.limit for p in gpu_check.STEPS) <= gpu_check.BUDGET == 720
    names = [p.name for p in gpu_check.STEPS]
    assert names[:5] == ["environment", "train", "offload", "checkpoint", "moe"]
    assert [p.name for p in gpu_check.STEPS if p.bench] == names[-4:]
    assert all(p.gpu_work < p.limit for p in gpu_check.STEPS)


def test_steps_past_the_budget_are_skipped_for_time_and_reported(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()
    out = tmp_path / "report"
    env_file = str(out / "env.json")
    describe = f"import json; json.dump({{'cuda_available': True}}, open({env_file!r}, 'w'))"
    monkeypatch.setattr(
        gpu_check, "environment_step", lambda o: python_step(gpu_check, "environment", describe, 30, o, env_file)
    )
    steps = [
        python_step(gpu_check, "train", "import time; time.sleep(1)", 30, out),
        python_step(gpu_check, "offload", "import time; time.sleep(60)", 60, out),
        python_step(gpu_check, "mfu", "pass", 30, out),
    ]
    monkeypatch.setattr(gpu_check, "plan_steps", lambda o, cuda, dry_run_tests: steps)
    monkeypatch.setattr(gpu_check, "MIN_STEP", 2)
    monkeypatch.delenv("OUT", raising=False)
    report = gpu_check.run_lane(str(out), None, False, budget=6)
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    assert statuses == {"environment": "passed", "train": "passed", "offload": "timeout", "mfu": "skipped"}, statuses
    assert report["steps"][2]["timeout"] < 6 and report["ok"] is False
    assert "skipped for time: mfu" in gpu_check.summary_line(report)
    assert "skipped for time" in (out / "report.md").read_text()


def test_a_benchmark_missing_from_the_checkout_is_skipped_cleanly(tmp_path, monkeypatch):
    """benchmarks/host_optimizer.py comes from another branch: absent, its step is skipped with
    the reason and the lane stays ok; every other step is planned as usual."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))  # a checkout without the benchmarks
    steps = {s.name: s for s in gpu_check.plan_steps(str(tmp_path), cuda=True, dry_run_tests=False)}
    assert steps["host_optimizer"].skip == "benchmarks/host_optimizer.py is not in this checkout"
    result = gpu_check.run_step(steps["host_optimizer"], str(tmp_path))
    assert result["status"] == "skipped" and gpu_check.lane_ok(result, cuda=True)
    assert not steps["train"].skip and "tests/cuda/test_numerics.py" in steps["train"].argv


def event(cat, name, stream, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_counts_kernels_on_other_streams_only():
    trace = {
        "traceEvents": [
            event("kernel", "gemm", 7, 0, 100),
            event("kernel", "gemm", 7, 150, 100),  # compute stream
            event("kernel", "fill", 20, 300, 50),  # a kernel on the copy stream
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 50, 150),  # [50, 200): 50 + 50 covered
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 280, 100),  # [280, 380): only its own stream
            event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 7, 0, 500),  # not host-to-device
            event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 7, 400, 10),  # on the compute stream: 0
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0, "args": {"stream": 7}},
        ]
    }
    stats = stream_overlap(trace)
    assert stats["h2d_copies"] == 3 and stats["h2d_us"] == 260
    assert stats["overlap_us"] == 100
    assert stats["overlap_fraction"] == pytest.approx(100 / 260)
    assert stats["copy_streams"] == [7, 20] and stats["kernel_streams"] == [7, 20]


def test_overlapping_kernels_on_several_streams_count_once():
    trace = {
        "traceEvents": [
            event("kernel", "a", 7, 0, 100),
            event("kernel", "b", 8, 50, 100),
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 0, 200),
        ]
    }
    assert stream_overlap(trace)["overlap_us"] == 150


def test_no_copies_is_no_overlap():
    assert stream_overlap({"traceEvents": [event("kernel", "a", 7, 0, 100)]})["overlap_fraction"] == 0.0


# ----------------------------------------------------------------------------- the runner


def python_step(gpu_check, name, code, timeout, out, figures=None):
    return gpu_check.Step(name, [sys.executable, "-c", code], timeout, figures)


def test_timeout_kills_the_step_and_its_children(tmp_path):
    gpu_check = load_gpu_check()
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    start = time.monotonic()
    result = gpu_check.run_step(python_step(gpu_check, "hang", code, 3, tmp_path), str(tmp_path))
    assert result["status"] == "timeout" and result["returncode"] is None
    assert time.monotonic() - start < 20
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild got SIGTERM with the group; give it a moment to go
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the step's child process outlived the step's time limit")


def test_a_failing_step_does_not_stop_the_others_and_the_report_says_which(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()
    out, copy = tmp_path / "report", tmp_path / "OUT"
    figures = out / "ok.json"
    steps = [
        python_step(gpu_check, "broken", "import sys; print('boom'); sys.exit(3)", 30, out),
        python_step(
            gpu_check, "ok", f"import json; json.dump({{'x': 1}}, open({str(figures)!r}, 'w'))", 30, out, str(figures)
        ),
    ]
    env_file = str(out / "env.json")
    describe = f"import json; json.dump({{'cuda_available': False}}, open({env_file!r}, 'w'))"
    monkeypatch.setattr(
        gpu_check, "environment_step", lambda o: python_step(gpu_check, "environment", describe, 30, o, env_file)
    )
    monkeypatch.setattr(gpu_check, "plan_steps", lambda o, cuda, dry_run_tests: steps)
    monkeypatch.setenv("OUT", str(copy))
    report = gpu_check.run_lane(str(out), None, False)
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("environment", "passed"),
        ("broken", "failed"),
        ("ok", "passed"),
    ]
    assert report["ok"] is False and report["mode"].startswith("cpu-trial")
    assert report["steps"][1]["returncode"] == 3 and "boom" in report["steps"][1]["log_tail"]
    assert report["steps"][2]["figures"] == {"x": 1}
    saved = json.loads((copy / "report.json").read_text())
    assert saved["steps"][1]["status"] == "failed"
    markdown = (copy / "report.md").read_text()
    assert "| broken |  | failed |" in markdown and "boom" in markdown
    assert "===== broken: failed" in (copy / "gpu_check.log").read_text()


@pytest.mark.parametrize("env_exit", [0, 1])
@pytest.mark.parametrize("cuda", [True, False])
def test_the_environment_step_decides_the_mode_even_when_it_fails(tmp_path, monkeypatch, cuda, env_exit):
    """A failing detail of the environment step (nvidia-smi, NCCL version) must not turn a GPU
    run into a CPU trial; on a GPU a skipped tests step is not ok, on CPU it is expected."""
    gpu_check = load_gpu_check()
    out = tmp_path / "report"
    env_file = str(out / "env.json")
    describe = (
        f"import json, sys; json.dump({{'cuda_available': {cuda}}}, open({env_file!r}, 'w')); sys.exit({env_exit})"
    )
    monkeypatch.setattr(
        gpu_check, "environment_step", lambda o: python_step(gpu_check, "environment", describe, 30, o, env_file)
    )
    seen = []

    def steps(o, cuda, dry_run_tests):
        seen.append(cuda)
        return [python_step(gpu_check, "train", "import sys; sys.exit(5)", 30, o)]

    monkeypatch.setattr(gpu_check, "plan_steps", steps)
    monkeypatch.delenv("OUT", raising=False)
    report = gpu_check.run_lane(str(out), None, False)
    assert seen == [cuda] and report["mode"].startswith("cuda" if cuda else "cpu-trial")
    assert [s["status"] for s in report["steps"]] == ["passed" if env_exit == 0 else "failed", "skipped"]
    assert report["ok"] is (env_exit == 0 and not cuda)


def test_junit_results_carry_outcomes_and_recorded_figures(tmp_path):
    gpu_check = load_gpu_check()
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.cuda.test_x" name="test_a" time="1.5"><properties>'
        "<property name=\"ratio\" value=\"{'measured': 10, 'planned': 11}\"/>"
        '<property name="device" value="NVIDIA H200"/></properties></testcase>'
        '<testcase classname="tests.cuda.test_x" name="test_b" time="0.1">'
        '<failure message="AssertionError: 0.3 &lt; 0.25">long traceback</failure></testcase>'
        '<testcase classname="tests.cuda.test_x" name="test_c" time="0"><skipped message="dry run"/></testcase>'
        "</testsuite></testsuites>"
    )
    results = gpu_check.junit_results(str(path))
    assert [(r["test"], r["outcome"]) for r in results] == [
        ("tests.cuda.test_x::test_a", "passed"),
        ("tests.cuda.test_x::test_b", "failed"),
        ("tests.cuda.test_x::test_c", "skipped"),
    ]
    assert results[0]["figures"] == {"ratio": {"measured": 10, "planned": 11}, "device": "NVIDIA H200"}
    assert results[1]["message"] == "AssertionError: 0.3 < 0.25"


def test_targets_are_judged_only_on_a_gpu():
    gpu_check = load_gpu_check()
    steps = {
        "mfu": {"figures": {"mfu": 0.5}},
        "offload_speed": {"figures": {"settings": {"50%": {"vs_0": 1.2, "vs_0_recompute": 1.05}}}},
    }
    on_gpu = gpu_check.targets(steps, cuda=True)
    assert [t["met"] for t in on_gpu] == [True, False]
    assert on_gpu[1]["value"] == pytest.approx(0.2) and on_gpu[1]["vs_recompute_baseline"] == pytest.approx(0.05)
    assert [t["met"] for t in gpu_check.targets(steps, cuda=False)] == [None, None]
    assert [t["value"] for t in gpu_check.targets({}, cuda=True)] == [None, None]
