"""A finished run ends cleanly: no process group outlives pretrain() (one destroyed during
interpreter finalization aborts the process: "terminate called without an active exception"),
and consecutive PP2 + offload runs, as real torchrun processes, exit 0 (docs/reliability.md says
how the 30-run check was made)."""

import os
import subprocess
import sys

from tests.harness import free_port, run_distributed
from tests.reliability.common import FLAGS, ROOT

PP2_OFFLOAD = FLAGS + [
    "--num-layers",
    "4",
    "--global-batch-size",
    "4",
    "--train-iters",
    "3",
    "--pipeline-model-parallel-size",
    "2",
    "--cpu-offload-layers",
    "1",
    "--log-interval",
    "1",
]


def _groups_left_after_pretrain(rank, world):
    import torch.distributed as dist
    from megatron_p2r.arguments import parse_args
    from megatron_p2r.training import pretrain

    before = len(dist.distributed_c10d._world.pg_map)
    pretrain(parse_args(PP2_OFFLOAD))
    return before, len(dist.distributed_c10d._world.pg_map)


def test_pretrain_destroys_every_group_it_created():
    for before, after in run_distributed(_groups_left_after_pretrain, 2):
        assert after == before == 1, (before, after)  # only the world group, its creator's to destroy


def test_consecutive_pp2_offload_runs_exit_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for run in range(int(os.environ.get("P2R_CLEAN_EXIT_RUNS", "3"))):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "pretrain_m6.py",
            *PP2_OFFLOAD,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in out, (
            f"run {run}: exit {proc.returncode}\n{out[-3000:]}"
        )
        assert "iteration      3/     3" in out


def _gathers_pending_at_teardown(rank, world):
    """Overlapped all-gathers of the distributed optimizer still in flight when the groups go."""
    import megatron_p2r.training.loop as training
    from megatron_p2r.arguments import parse_args
    from megatron_p2r.parallel.ddp import DistributedDataParallel

    made, pending = [], []
    init, release = DistributedDataParallel.__init__, training.release_groups

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def count_then_release(ps, completed):
        pending.append(sum(b.param_handle is not None for d in made for buf in d.buffers for b in buf.buckets))
        release(ps, completed)

    DistributedDataParallel.__init__, training.release_groups = record, count_then_release
    training.pretrain(
        parse_args(
            FLAGS
            + [
                "--global-batch-size",
                "4",
                "--train-iters",
                "2",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
            ]
        )
    )
    return pending


def test_the_last_overlapped_all_gather_is_waited_for_before_teardown():
    assert run_distributed(_gathers_pending_at_teardown, 2) == [[0], [0]]
