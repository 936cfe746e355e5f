"""The demo, shortened: every stage of the Pseudo-to-Real recipe runs end to end.

Checks what the demo promises: the eval loss before and after delinking (into another layout)
is equal, and the real phase's training loss decreases.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(path, key):
    return [json.loads(line)[key] for line in open(path) if key in line]


def test_short_demo_runs_every_stage(tmp_path):
    out = tmp_path / "demo"
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # the venv's python
    env = dict(
        os.environ,
        PATH=path,
        DEMO_OUT=str(out),
        DEMO_PSEUDO_ITERS="6",
        DEMO_REAL_ITERS="12",
        DEMO_CORPUS_BYTES="600000",
        DEMO_EXTRA_ARGS="--log-interval 1 --eval-iters 2 --split 80,20,0",
    )  # 22 docs: 2% would be none
    r = subprocess.run(
        ["bash", "examples/tiny_p2r/run_demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    before = _records(out / "eval_pseudo.jsonl", "eval_loss")[-1]
    after = _records(out / "eval_real_init.jsonl", "eval_loss")[-1]
    assert abs(before - after) < 1e-4 * max(1.0, abs(before))  # delinking preserves the function
    real = _records(out / "real.jsonl", "lm_loss")
    assert len(real) == 12
    assert sum(real[-3:]) / 3 < sum(real[:3]) / 3  # the real phase trains
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "Pseudo-to-Real demo finished" in r.stdout and "equal" in r.stdout
    phases = {json.loads(line).get("phase") for line in open(out / "pseudo.jsonl")}
    assert phases == {"pseudo"}
