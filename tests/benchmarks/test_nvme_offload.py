"""benchmarks/nvme_offload.py runs and prints its figures (a small model, one round)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_nvme_offload_benchmark_prints_every_setting(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/nvme_offload.py",
            "--rounds",
            "1",
            "--layers",
            "1",
            "--hidden",
            "64",
            "--dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "figures.json"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for label in (
        "RAM",
        "file, mapped, dirty",
        "file, in page cache, written back",
        "file, from disk, read ahead",
        "file, from disk, no read-ahead",
        "read-ahead / none, from disk:",
    ):
        assert label in out.stdout, label
    assert os.path.exists(tmp_path / "figures.json") and not any(p.suffix == ".bin" for p in tmp_path.rglob("*"))
