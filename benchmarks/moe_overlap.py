"""--overlap-moe-expert-parallel-comm on CPU: the serial and the overlapped step side by side, and
the planner's model of the exposed all-to-all time against the measured one.

    python benchmarks/moe_overlap.py [--rounds 3] [--microbatches 4] [--pp 1] [--recompute]

Two gloo processes (EP=2, DP=2), one thread each (with ``--pp 2`` four, PP=2 x EP=2, the serial
1F1B schedule against the combined 1F1B one): a 4-layer MoE model (hidden 256, 8 experts of
FFN 512, top-2, dropless), micro-batches of 4 x 256 tokens. Each round runs one forward/backward
step of each schedule (interleaved, medians over rounds; the step's gradient reduction included).
Time spent in the all-to-alls is measured around them: in the serial step all of it is
exposed; in the overlapped step only the time a rank waits for one (and starts it) is. The planner's
``exposed_ep`` is then fed the serial step's figures (all-to-all time and the rest, per
micro-batch; the rest is the serial schedule's busy time less its all-to-alls, so that a
pipeline's idle waits do not count, and each stage's combined warm-up is unpaired) and its
prediction is printed next to the measured exposed time. On one host the
all-to-all is a copy through loopback TCP, a small share of the step, so the step gains little:
the figure to read is the exposed share. ``--recompute``: both schedules with full recomputation
(``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``); the serial
one sends its all-to-alls again when it recomputes, the overlapped one does not, so the planner
is fed 2/3 of the serial all-to-all time and the backward's share of the compute with its
recomputed forward.
"""

from __future__ import annotations

import os
import sys
import argparse
import functools
import statistics
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.harness: local gloo ranks

import torch  # noqa: E402

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.moe import aux_loss  # noqa: E402
from megatron_p2r.parallel import mappings  # noqa: E402
from megatron_p2r.pipeline import a2a_overlap  # noqa: E402
from megatron_p2r.pipeline.a2a_pipelined import forward_backward_combined_1f1b  # noqa: E402
from megatron_p2r.pipeline.order import combined_warmup  # noqa: E402
from megatron_p2r.pipeline.schedules import get_forward_backward_func  # noqa: E402
from megatron_p2r.planning.estimate import exposed_ep  # noqa: E402

MODEL = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=256,
    vocab_size=1024,
    micro_batch_size=4,
    mock_data=True,
    num_experts=8,
    moe_ffn_hidden_size=512,
    moe_router_topk=2,
    expert_model_parallel_size=2,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


class _AllToAllClock:
    """Seconds spent starting and waiting for all-to-alls, wrapped around both schedules' calls."""

    def __init__(self):
        self.seconds, self.original = 0.0, mappings.start_all_to_all

    def start(self, *args, **kwargs):
        began = time.perf_counter()
        out, wait = self.original(*args, **kwargs)
        self.seconds += time.perf_counter() - began

        def timed_wait():
            began = time.perf_counter()
            wait()
            self.seconds += time.perf_counter() - began

        return out, timed_wait

    def install(self):
        mappings.start_all_to_all = a2a_overlap.start_all_to_all = self.start


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _worker(rank: int, world: int, rounds: int, microbatches: int, pp: int, recompute: bool) -> dict:
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.parallel.state import initialize_plan
    from megatron_p2r.training import build_train_state

    cfg = config_from_values(
        {
            **MODEL,
            **(FULL if recompute else {}),
            "pipeline_model_parallel_size": pp,
            "global_batch_size": 2 * MODEL["micro_batch_size"] * microbatches,
        }
    )
    plan = ParallelPlan.for_world(cfg, world)
    ps = initialize_plan(plan, torch.device("cpu"))
    state = build_train_state(cfg, ps, plan)
    g = torch.Generator().manual_seed(rank)
    mbs = []
    for _ in range(microbatches):
        tokens = torch.randint(
            0, MODEL["vocab_size"], (MODEL["micro_batch_size"], MODEL["seq_length"] + 1), generator=g
        )
        mbs.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(tokens[:, 1:].shape)})
    clock = _AllToAllClock()
    clock.install()
    serial_stats: dict = {}  # the serial schedule's busy time: its step less the pipeline's idle waits
    schedules = {
        "serial": functools.partial(get_forward_backward_func(plan.schedule.serial), stats=serial_stats),
        "overlapped": forward_backward_combined_1f1b,
    }
    times = {name: {"step": [], "a2a": []} for name in schedules}
    times["serial"]["busy"] = []
    for r in range(rounds + 1):  # round 0 warms up
        for name, schedule in schedules.items():
            state.ddp.zero_grad_buffer(microbatches)
            torch.distributed.barrier()
            clock.seconds, began = 0.0, time.perf_counter()
            schedule(state.model, mbs, ps, on_backward_scale=aux_loss.set_backward_scale)
            state.ddp.finish_grad_sync()
            if r:
                times[name]["step"].append(time.perf_counter() - began)
                times[name]["a2a"].append(clock.seconds)
                if name == "serial":
                    times[name]["busy"].append(serial_stats["busy_s"])
    medians = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    return {**medians, "stage": ps.pp_rank}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        choices=[1, 2],
        help="pipeline stages: 2 runs 1F1B against combined 1F1B on 4 processes",
    )
    parser.add_argument("--recompute", action="store_true", help="full recomputation, one layer per unit")
    args = parser.parse_args(argv)
    from tests.harness import run_distributed

    results = run_distributed(
        _worker, 2 * args.pp, args.rounds, args.microbatches, args.pp, args.recompute, timeout=600
    )
    kept = 2 / 3 if args.recompute else 1.0  # the recomputed pass's all-to-alls are not sent again
    m = args.microbatches
    for rank, r in enumerate(results):
        serial, overlapped, unpaired = r["serial"], r["overlapped"], combined_warmup(args.pp, 1, m, r["stage"])
        a2a, rest = serial["a2a"] / m, (serial["busy"] - serial["a2a"]) / m
        print(
            f"rank {rank} (stage {r['stage']}): serial step {serial['step']:.3f} s (all-to-alls "
            f"{serial['a2a']:.3f} s), overlapped {overlapped['step']:.3f} s (exposed all-to-alls "
            f"{overlapped['a2a']:.3f} s): {overlapped['step'] / serial['step']:.3f}x; planner's exposed_ep on "
            f"the serial figures: {m * exposed_ep(a2a * kept, rest, m, unpaired, float(args.recompute)):.3f} s"
        )


if __name__ == "__main__":
    main()
