"""Helpers of the checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import List

from megatron_p2r.config import Config
from tests.helpers import tiny_config

# Exercises everything a resume must restore: LR warm-up + cosine decay, clipping, weight
# decay, and dropout (RNG streams) on residual branches and attention probabilities.
RESUME = dict(
    train_iters=4,
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    clip_grad=1.0,
    weight_decay=0.01,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    device="cpu",
    log_interval=100,
)


def cfg_of(**values) -> Config:
    return tiny_config(**{**RESUME, **values})


def shard_files(iter_dir: str) -> List[str]:
    """Every tensor file of a checkpoint iteration (shards and RNG files), relative paths."""
    out = []
    for root, _, files in os.walk(iter_dir):
        out += [os.path.relpath(os.path.join(root, f), iter_dir) for f in files if f.endswith(".safetensors")]
    return sorted(out)


def same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def metadata(iter_dir: str) -> dict:
    with open(os.path.join(iter_dir, "metadata.json"), encoding="utf-8") as fh:
        return json.load(fh)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PEAK_RSS = textwrap.dedent("""
    import importlib, sys

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    module = importlib.import_module(sys.argv[1])
    inner = getattr(module, sys.argv[2])
    def measured(*args, **kwargs):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset this process's peak RSS (VmHWM)
        before = status("VmRSS")
        inner(*args, **kwargs)
        print("STREAM", before, status("VmHWM"), flush=True)
    setattr(module, sys.argv[2], measured)
    exec(sys.argv[3])
""")


def streaming_rss_growth(module: str, function: str, statement: str) -> int:
    """How many bytes the peak RSS of a fresh process grows by while ``module.function`` runs,
    when the Python ``statement`` calls it (the converters' streaming loops)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, module, function, statement],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    before, peak = map(int, proc.stdout.split("STREAM")[1].split())
    return peak - before
