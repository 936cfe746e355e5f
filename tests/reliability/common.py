"""Helpers of the reliability tests: run ``pretrain_m6.main(argv)`` as real processes, cheaply.

``launch(argv, nproc)`` starts ``nproc`` ranks the way torchrun would (RANK, WORLD_SIZE,
MASTER_ADDR/PORT in the environment) but forks them from the test harness's forkserver, which
has torch imported already: a process that can be SIGKILLed costs a fork, not a 2-3 s start.
Each rank's stdout and stderr go to a file; a Python exception escaping ``main`` is recorded as
exit code ``TRACEBACK`` so tests can tell a clear error from a crash.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import torch.multiprocessing as mp

from tests.harness import PRELOAD, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACEBACK = 99
# A tiny model; dropout makes a bitwise resume depend on the restored RNG streams.
FLAGS = [
    "--mock-data",
    "--vocab-size",
    "200",
    "--make-vocab-size-divisible-by",
    "16",
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
    "--lr",
    "1e-2",
    "--lr-warmup-iters",
    "1",
    "--hidden-dropout",
    "0.1",
    "--seed",
    "7",
    "--device",
    "cpu",
    "--log-interval",
    "100",
    "--lr-decay-iters",
    "16",
]  # a warm-up ends before the decay, also in 1-step runs


def _rank_main(argv: Sequence[str], env: Dict[str, str], out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    import pretrain_m6

    try:
        rc = pretrain_m6.main(list(argv))
    except BaseException:
        traceback.print_exc()
        rc = TRACEBACK
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def launch(
    argv: Sequence[str],
    nproc: int = 1,
    env: Optional[Dict[str, str]] = None,
    out_dir: str = ".",
    timeout: float = 120.0,
) -> List[Tuple[int, str]]:
    """(exit code, output) of each rank; -9 is SIGKILL. Fails if a rank is still running after ``timeout``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = free_port()
    procs, outs = [], []
    for rank in range(nproc):
        rank_env = dict(env or {}, OMP_NUM_THREADS="1")
        if nproc > 1:
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        out = os.path.join(out_dir, f"rank{rank}.{free_port()}.log")
        p = ctx.Process(target=_rank_main, args=(list(argv), rank_env, out))
        p.start()
        procs.append(p)
        outs.append(out)
    for p in procs:
        p.join(timeout)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = [
        (p.exitcode, open(o, encoding="utf-8", errors="replace").read()) for p, o in zip(procs, outs, strict=True)
    ]
    for o in outs:
        os.unlink(o)
    assert not alive, f"ranks {alive} still running after {timeout}s (hang): {results}"
    return results


def tree_digest(path: str) -> Dict[str, str]:
    """{relative path: sha256} of every file under ``path`` (links reported, not followed)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                out[rel] = "link->" + os.readlink(full)
            else:
                with open(full, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def checkpoint_tensor_files(iter_dir: str) -> Dict[str, str]:
    """Digests of the tensor files (model/optimizer shards, RNG states) of one checkpoint."""
    return {k: v for k, v in tree_digest(iter_dir).items() if k.endswith(".safetensors")}
