"""Fully parallel checkpoint save: DP4 save time vs DP1, and peak host memory during a save
relative to the rank's own optimizer state, fully parallel vs one writer per shard; and the
training stall per save with and without ``--async-save``.

    python benchmarks/parallel_save.py [--hidden 512] [--layers 4] [--vocab 16000] [--repeats 3]
                                       [--steps-between 2]

The same model (fp32, AdamW moments after one step, the distributed optimizer on DP4) is saved
on one process (DP1), on 4 gloo ranks with a fully parallel save (each rank writes its shard of
mains and moments) and with ``--no-ckpt-fully-parallel-save`` (rank 0 gathers and writes the
whole shard). Time: the fastest of ``--repeats`` saves (barrier to barrier, after a warm-up
save), each rank's files fsynced. Memory: each rank's peak RSS (VmHWM, reset right before the
save) minus its RSS before it, over the bytes of the fp32 mains and moments it steps.
Stall: on DP2, ``--repeats`` saves (after a warm-up one), each followed by ``--steps-between``
training steps; the stall is the time a save keeps training waiting (synchronous: the whole
save; asynchronous: the host copy, plus waiting for and publishing the previous save), the
median over saves and the larger over ranks; the steps between saves are timed too, since the
background writer shares the CPU with training.
Ranks share the machine's cores: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _values(args, fully_parallel: bool, async_save: bool = False) -> dict:
    return dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        seq_length=64,
        vocab_size=args.vocab,
        mock_data=True,
        micro_batch_size=1,
        global_batch_size=4,
        use_distributed_optimizer=True,
        ckpt_fully_parallel_save=fully_parallel,
        train_iters=1000,
        async_save=async_save,
        keep_last=2,
    )


def _measure(rank: int, world: int, args, fully_parallel: bool, root: str) -> dict:
    """On every rank: (fastest save seconds, peak RSS growth during a save, own state bytes)."""
    import torch
    import torch.distributed as dist
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.checkpoint.io import save_checkpoint
    from megatron_p2r.config import num_microbatches
    from megatron_p2r.training import build_datasets, build_train_state, microbatch_iterator, setup_parallel, train_step

    cfg = config_from_values(_values(args, fully_parallel))
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    state = build_train_state(cfg, ps)
    data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
    train_step(state, [next(data) for _ in range(num_microbatches(cfg, ps.layout.world_size))])  # moments exist
    own = 3 * 4 * sum(ms.end - ms.start for ms in state.optimizer.shards)
    times, growth = [], 0
    for i in range(args.repeats + 1):
        shutil.rmtree(root, ignore_errors=True) if rank == 0 else None
        if world > 1:
            dist.barrier()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # reset this process's peak RSS
        before, start = _status("VmRSS"), time.perf_counter()
        save_checkpoint(root, state)
        if i:
            times.append(time.perf_counter() - start)
            growth = max(growth, _status("VmHWM") - before)
    return {"seconds": min(times), "growth": growth, "own": own}


def _stall(rank: int, world: int, args, async_save: bool, root: str) -> dict:
    """On every rank: median seconds a save stops training, and median seconds of the steps after it."""
    import statistics

    import torch
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.checkpoint.async_save import finish_pending, save_checkpoint
    from megatron_p2r.config import num_microbatches
    from megatron_p2r.training import build_datasets, build_train_state, microbatch_iterator, setup_parallel, train_step

    cfg = config_from_values(_values(args, True, async_save))
    ps, _ = setup_parallel(cfg, torch.device("cpu"))
    state = build_train_state(cfg, ps)
    data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
    n = num_microbatches(cfg, ps.layout.world_size)
    stalls, steps = [], []
    for i in range(args.repeats + 2):
        start = time.perf_counter()
        if i:
            save_checkpoint(root, state)
            stalls.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(args.steps_between):
            train_step(state, [next(data) for _ in range(n)])
        steps.append(time.perf_counter() - start)
    finish_pending(ps)
    return {"stall": statistics.median(stalls[1:]), "steps": statistics.median(steps[2:])}


def _one_process(args, root: str) -> dict:
    from tests.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return _measure(0, 1, args, True, root)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=2, help="training steps between two saves (stall rows)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.harness import run_distributed

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        dp1 = _one_process(args, os.path.join(tmp, "dp1"))
        par = run_distributed(_measure, 4, args, True, os.path.join(tmp, "par"), timeout=1800)
        one = run_distributed(_measure, 4, args, False, os.path.join(tmp, "one"), timeout=1800)
        stall = {
            mode: run_distributed(_stall, 2, args, mode, os.path.join(tmp, f"stall{mode}"), timeout=1800)
            for mode in (False, True)
        }
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"state (fp32 mains + 2 moments) {dp1['own'] / 2**20:.0f} MiB"
    )
    print(f"{'save':38s} {'s':>6s} {'vs DP1':>7s} {'peak host growth / own state (max over ranks)':>47s}")
    rows = [("DP1", [dp1]), ("DP4, fully parallel (4 writers)", par), ("DP4, --no-ckpt-fully-parallel-save", one)]
    for name, ranks in rows:
        seconds = max(r["seconds"] for r in ranks)
        ratio = max(r["growth"] / r["own"] for r in ranks)
        print(f"{name:38s} {seconds:6.2f} {seconds / dp1['seconds']:6.2f}x {ratio:46.2f}x")
    sync, asynchronous = ({k: max(r[k] for r in stall[mode]) for k in ("stall", "steps")} for mode in (False, True))
    print(
        f"DP2, a save every {args.steps_between} steps: training stall per save {sync['stall']:.3f} s synchronous, "
        f"{asynchronous['stall']:.3f} s with --async-save ({asynchronous['stall'] / sync['stall']:.2f}x); "
        f"the steps between saves {asynchronous['steps'] / sync['steps']:.2f}x as long with it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
