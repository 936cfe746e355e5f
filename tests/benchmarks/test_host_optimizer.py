"""benchmarks/host_optimizer.py --quick writes the JSON the planner's --host-calibration reads."""

import json
import os
import subprocess
import sys

import pytest

from megatron_p2r.optim import host_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_KEYS = {
    "name": str,
    "optimizer": str,
    "main": str,
    "grad": str,
    "moments": dict,
    "weight": (str, type(None)),
    "threads": int,
    "ns_per_element": float,
    "bytes_per_element": int,
    "gbs": float,
    "ratio_to_triad": float,
}


@pytest.mark.skipif(not host_kernels.available(), reason="no C++ compiler for the host kernels")
def test_quick_run_writes_the_calibration_schema(tmp_path):
    path = tmp_path / "host.json"
    out = subprocess.run(
        [sys.executable, "benchmarks/host_optimizer.py", "--quick", "--json", str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "targets (issue 37):" in out.stdout
    report = json.loads(path.read_text())
    assert isinstance(report["cpu"], str) and report["cores"] == len(os.sched_getaffinity(0))
    assert set(report["triad_gbs"]) == {"1", str(report["cores"])}
    assert all(isinstance(v, float) and v > 0 for v in report["triad_gbs"].values())
    assert {r["optimizer"] for r in report["results"]} == {"adam", "lion", "adafactor"}
    for r in report["results"]:
        for key, kind in RESULT_KEYS.items():
            assert isinstance(r[key], kind), (r["name"], key)
        assert r["main"] in ("fp32", "fp16") and r["grad"] in ("fp32", "bf16") and r["weight"] in ("bf16", "fp16", None)
        assert str(r["threads"]) in report["triad_gbs"]
    assert len(report["results"]) == len(report["triad_gbs"]) * len({r["name"] for r in report["results"]})
