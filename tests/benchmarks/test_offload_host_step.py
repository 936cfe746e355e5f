"""benchmarks/offload.py --predict-host-step prints the measured host step beside the planner's
prediction for the calibrated host (a tiny model, one timed step)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_predict_host_step_prints_both_and_the_ratio(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/offload.py",
            "--predict-host-step",
            "tests/fixtures/host_calibration.json",
            "--threads",
            "1",
            "--shape",
            "micro",
            "--steps",
            "1",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "figures.json"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "host step, 50% offloaded (2 of 4 layers): measured " in out.stdout and "predicted / measured" in out.stdout
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["ratio"] == figures["predicted_s"] / figures["measured_s"] > 0
    # 28 B per element at the fixture's 1-thread triad (it has no row for fp32 weights as their own mains)
    assert figures["host_step"]["bytes_per_element"] == 28 and figures["host_step"]["thread_bw"] == 12e9
