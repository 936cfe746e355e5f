"""Pipeline bubble of GPipe, 1F1B and interleaved 1F1B on 4 CPU processes, against the ideal.

Every stage does the same work per micro-batch and runs the project's real schedules and
p2p (``megatron_p2r.pipeline``) over gloo. For each schedule and number of micro-batches m it
reports the step time (slowest rank, median of --repeats steps) against the ideal
slots·(t_f+t_b) — slots = m+P-1 for GPipe and 1F1B, m+(P-1)/v for interleaved 1F1B with v
model chunks per rank (``order.step_slots``: the schedule run on uniform stages; more when
m < P) — and against slots·(t_f+t_b+2·v·p2p) (each slot also waits for a forward and a
backward transfer per chunk, measured by ping-pong; with --overlap-p2p-communication
("v=2 overlap") only what ``planning.estimate.exposed_p2p`` says outlasts compute); the bubble, measured as the mean over
stages of idle time / busy time, against the ideal (P-1)/m, or (P-1)/(v·m) interleaved; and
the peak number of (micro-batch, chunk) forwards a stage holds.

``--work sleep`` (default) makes a stage's compute a fixed wait (forward t_f, backward 2·t_f,
split evenly over its chunks) inside autograd: 4 ranks then behave like 4 devices although
this machine has 2 cores, so the figures show the schedules, not CPU contention. ``--work
matmul`` runs real GELU-MLP layers instead; with more ranks than cores, stages that should
overlap share a core and the busy fractions are inflated (useful on a machine with >= 4 free
cores).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_bubble.py
"""

from __future__ import annotations

import os
import sys
import argparse
import statistics
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.harness: local gloo ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from megatron_p2r.parallel.state import Layout, initialize  # noqa: E402
from megatron_p2r.planning.estimate import exposed_p2p  # noqa: E402
from megatron_p2r.pipeline.order import BACKWARD, FORWARD, Message, step_slots  # noqa: E402
from megatron_p2r.pipeline.p2p import StageLink  # noqa: E402
from megatron_p2r.pipeline.transfers import Transfers  # noqa: E402
from megatron_p2r.config.schedule import GPIPE, INTERLEAVED, ONE_F_ONE_B, SchedulePlan  # noqa: E402
from megatron_p2r.pipeline.schedules import get_forward_backward_func  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

STAGES = 4


class _FixedWork(torch.autograd.Function):
    """Identity that takes ``seconds`` in forward and twice that in backward (a stand-in device)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class UniformStage(nn.Module):
    """A pipeline stage with M6Model's calling convention (``chunk=c`` runs model chunk c) and
    the same work on every stage, split evenly over its ``chunks``."""

    def __init__(self, hidden: int, rank: int, stages: int, chunks: int, work: str, fwd_seconds: float, layers: int):
        super().__init__()
        self.rank, self.stages, self.num_model_chunks = rank, stages, chunks
        self.work, self.fwd_seconds, self.hidden = work, fwd_seconds / chunks, hidden
        n = layers // chunks if work == "matmul" else 1
        mlp = [(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(n * chunks)]
        self.chunks = nn.ModuleList(
            nn.Sequential(*[m for pair in mlp[c * n : (c + 1) * n] for m in pair]) for c in range(chunks)
        )

    def hidden_spec(self, tokens_shape):
        return (*tokens_shape, self.hidden), torch.float32

    def forward(self, tokens=None, hidden=None, labels=None, loss_mask=None, chunk=0):
        x = hidden
        if self.rank == 0 and chunk == 0:
            x = tokens.float().unsqueeze(-1).expand(*tokens.shape, self.hidden) / 1000.0
        x = self.chunks[chunk](x)
        if self.work == "sleep":
            x = _FixedWork.apply(x, self.fwd_seconds)
        if self.rank == self.stages - 1 and chunk == self.num_model_chunks - 1:
            return (x.pow(2).mean(-1) * loss_mask).sum()  # the masked sum of a per-token "loss"
        return x


def _p2p_latency(ps, shape, rounds: int = 30) -> float:
    """One-way time of one activation transfer, from ping-pongs 0 <-> 1."""
    x = torch.randn(shape)
    there, back = Message(FORWARD, 0, 1), Message(BACKWARD, 0, 0)
    incoming = Transfers({0: {1: [back]}, 1: {0: [there]}}.get(ps.pp_rank, {}), {}, frozenset())
    times = []
    for _ in range(rounds):
        link = StageLink(ps, incoming, lambda msg: (tuple(shape), x.dtype))
        dist.barrier()
        start = time.perf_counter()
        if ps.pp_rank == 0:
            link.send(there, x, 1)
            link.recv(back, 1)
        elif ps.pp_rank == 1:
            link.send(back, link.recv(there, 0), 0)
        times.append((time.perf_counter() - start) / 2)
        link.wait()
    return statistics.median(times)


# (label, model chunks per rank, schedule kind, receives posted ahead)
RUNS = (
    ("gpipe", 1, GPIPE, False),
    ("1f1b", 1, ONE_F_ONE_B, False),
    ("1f1b v=2", 2, INTERLEAVED, False),
    ("v=2 overlap", 2, INTERLEAVED, True),
)


def _rank(rank: int, world: int, args: argparse.Namespace) -> list:
    ps = initialize(Layout(pp=world), torch.device("cpu"))
    torch.manual_seed(0)
    b, s = args.micro_batch, args.seq
    rows = [{"p2p_s": _p2p_latency(ps, (b, s, args.hidden))}]
    for m in args.microbatches:
        mbs = [
            {
                "tokens": torch.randint(0, 1000, (b, s)),
                "labels": torch.zeros(b, s, dtype=torch.long),
                "loss_mask": torch.ones(b, s),
            }
            for _ in range(m)
        ]
        for name, chunks, kind, ahead in RUNS:
            schedule = get_forward_backward_func(SchedulePlan(kind, world, chunks, posts_receives_ahead=ahead))
            model = UniformStage(args.hidden, rank, world, chunks, args.work, args.fwd_ms / 1000.0, args.layers)
            steps = []
            for rep in range(args.repeats + 1):  # the first is a warm-up
                stats = {}
                dist.barrier()
                start = time.perf_counter()
                schedule(model, mbs, ps, stats=stats)
                elapsed = time.perf_counter() - start
                if rep:
                    steps.append((elapsed, stats["busy_s"], stats["peak_inflight"]))
                model.zero_grad(set_to_none=True)
            rows.append({"schedule": name, "m": m, "stage": ps.pp_rank, "steps": steps})
    return rows


def _fwd_bwd_seconds(args) -> float:
    """t_f + t_b of one micro-batch on one stage, measured on one process (same module)."""
    stage = UniformStage(args.hidden, 0, 1, 1, args.work, args.fwd_ms / 1000.0, args.layers)
    tokens = torch.randint(0, 1000, (args.micro_batch, args.seq))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        stage(tokens=tokens, loss_mask=torch.ones(tokens.shape)).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", choices=["sleep", "matmul"], default="sleep")
    parser.add_argument("--fwd-ms", type=float, default=40.0, help="sleep work: forward time per micro-batch")
    parser.add_argument("--layers", type=int, default=4, help="matmul work: MLP layers per stage")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--microbatches", type=lambda v: [int(x) for x in v.split(",")], default=[2, 4, 6, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    t_mb = _fwd_bwd_seconds(args)
    per_rank = run_distributed(_rank, STAGES, args, timeout=900)
    p2p_s = per_rank[0][0]["p2p_s"]
    results = [row for rank_rows in per_rank for row in rank_rows[1:]]
    P = STAGES
    what = (
        f"forward {args.fwd_ms:.1f} ms + backward {2 * args.fwd_ms:.1f} ms (fixed waits)"
        if args.work == "sleep"
        else f"{args.layers}-layer GELU MLP, hidden {args.hidden}, {args.micro_batch}x{args.seq} tokens"
    )
    print(
        f"P={P} stages on {P} gloo CPU processes; per micro-batch and stage: {what}; "
        f"t_f+t_b measured alone = {1000 * t_mb:.1f} ms; one p2p transfer "
        f"({args.micro_batch}x{args.seq}x{args.hidden} fp32) = {1000 * p2p_s:.2f} ms one way; "
        f"median of {args.repeats} steps"
    )
    header = (
        f"{'schedule':11} {'m':>3} {'step ms':>8} {'ideal ms':>8} {'ratio':>6} {'+p2p ms':>8} "
        f"{'busy s0   s1   s2   s3':>22} {'bubble':>7} {'ideal':>6} {'peak in-flight s0..s3':>22}"
    )
    print(header)
    print("-" * len(header))
    for m in args.microbatches:
        for name, chunks, _ in RUNS:
            per_stage = sorted((r for r in results if r["schedule"] == name and r["m"] == m), key=lambda r: r["stage"])
            # One step's time is that of its slowest rank; busy fractions are against it.
            step_times = [max(r["steps"][i][0] for r in per_stage) for i in range(args.repeats)]
            i_med = step_times.index(statistics.median_low(step_times))
            step = step_times[i_med]
            busy = [r["steps"][i_med][1] / step for r in per_stage]
            peaks = [max(x[2] for x in r["steps"]) for r in per_stage]
            slots = step_slots("gpipe" if name == "gpipe" else "1f1b", P, chunks, m)
            bubble = sum((1 - f) / f for f in busy) / P  # idle / busy, mean over stages
            waited = 2 * chunks * p2p_s  # a slot's transfers; overlapped, what the planner says outlasts compute
            waited = exposed_p2p(waited, t_mb) if "overlap" in name else waited
            print(
                f"{name:11} {m:>3} {1000 * step:>8.1f} {1000 * slots * t_mb:>8.1f} {step / (slots * t_mb):>6.2f} "
                f"{1000 * slots * (t_mb + waited):>8.1f} "
                f"{'  ' + ' '.join(f'{b:.2f}' for b in busy):>22} {bubble:>7.3f} {slots / m - 1:>6.3f} "
                f"{' '.join(str(p) for p in peaks):>22}"
            )


if __name__ == "__main__":
    main()
