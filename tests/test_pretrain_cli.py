"""The command line: torchrun TP=2 reproduces the single-process run's logged losses."""

import json
import os
import subprocess
import sys

import pytest

from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [
    "--mock-data",
    "--vocab-size",
    "300",
    "--make-vocab-size-divisible-by",
    "32",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "3",
    "--lr",
    "1e-2",
    "--seed",
    "3",
    "--log-interval",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]  # TP draws attention dropout per rank


def _run(cmd, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _losses(path):
    return [json.loads(line)["lm_loss"] for line in open(path) if "lm_loss" in line]


def test_torchrun_tensor_parallel_matches_single_process(tmp_path):
    single, tp2 = tmp_path / "single.jsonl", tmp_path / "tp2.jsonl"
    r1 = _run([sys.executable, "pretrain_m6.py", *FLAGS, "--log-file", str(single)])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "pretrain_m6.py",
            *FLAGS,
            "--tensor-model-parallel-size",
            "2",
            "--log-file",
            str(tp2),
        ]
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert len(_losses(single)) == 3
    assert _losses(tp2) == pytest.approx(_losses(single), rel=1e-5)
    assert "TFLOP/s per rank" in r1.stdout


def test_cli_config_error_exits_with_message():
    r = _run([sys.executable, "pretrain_m6.py", *FLAGS, "--num-attention-heads", "5"])
    assert r.returncode == 2
    assert "--hidden-size (32) must be divisible by --num-attention-heads (5)" in r.stderr
