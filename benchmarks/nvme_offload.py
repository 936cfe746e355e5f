"""The host optimizer step with the offloaded layers' fp32 mains and AdamW state in RAM against
the same step reading them from the memory-mapped file of --cpu-offload-optimizer-nvme-path,
side by side in one run, on this machine's disk.

    python benchmarks/nvme_offload.py [--rounds 5] [--dir DIR] [--hidden 1024] [--layers 8] [--json PATH]

Two training states of one model (bf16 weights, AdamW, every layer offloaded: ``--layers`` of
``--hidden``), one with the state in RAM, one with it in a file under ``--dir`` (default: a
temporary directory on the disk holding /tmp), each trained one step, then the host step alone
(``optimizer.host.submit(1.0)``, one torch thread) timed in interleaved rounds, medians:

- ``RAM``: the state in the rank's memory;
- ``file, mapped, dirty``: right after another step, the file's pages still cached, mapped and
  dirty (a host with RAM to spare, steps closer together than the kernel's write-back); with
  and without the read-ahead, which then only walks pages already there;
- ``file, in page cache, written back``: the pages cached but written back (``msync``) since
  the last step, as the kernel does within 30 s (``vm.dirty_expire_centisecs``): the step's
  first write to each 4 KiB page faults;
- ``file, from disk``: the pages written back and dropped from the page cache before the step
  (``posix_fadvise(DONTNEED)``), and the step's dirty pages written back within the timed step:
  a host that cannot cache the state reads and writes all of it every step. With the next
  layer's pages read ahead and mapped on the reader thread (``MADV_POPULATE_WRITE``, what the
  code does) and, to measure what that buys, without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402

from measure import random_microbatches, write_json  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.layout.offload import format_bytes  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SETTINGS = [  # label, state in the file, what precedes the step (untimed), its pages read ahead
    ("RAM", False, "step", True),
    ("file, mapped, dirty", True, "step", True),
    ("file, mapped, dirty, no read-ahead", True, "step", False),
    ("file, in page cache, written back", True, "flush", True),
    ("file, from disk, read ahead", True, "evict", True),
    ("file, from disk, no read-ahead", True, "evict", False),
]


def build(args, directory):
    values = dict(
        vocab_size=2048,
        make_vocab_size_divisible_by=128,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=8,
        seq_length=32,
        micro_batch_size=1,
        global_batch_size=1,
        mock_data=True,
        bf16=True,
        cpu_offload_layers="1.0",
        cpu_offload_optimizer_nvme_path=directory,
        device="cpu",
    )
    state = build_train_state(config_from_values(values), ParallelState.single())
    train_step(state, random_microbatches(2048, 32, 1, torch.device("cpu")))  # creates the AdamW state
    state.optimizer.prepare_grads()  # the host step's gradients, kept for every timed step
    return state


def timed_step(state, before: str, read_ahead: bool) -> float:
    """Seconds of one host step after ``before``: another step (its pages stay mapped and dirty),
    a write-back of the file (clean pages: the step's first write to each faults), or an eviction
    (the step reads the file from disk; its write-back is then timed with it)."""
    nvme, host = state.offload.nvme, state.optimizer.host
    if nvme is not None:
        nvme.file.prefetch_enabled = read_ahead
    if before == "step":
        host.submit(1.0)
    elif before == "flush":
        nvme.file.map.flush()
    else:
        nvme.file.evict()
    begin = time.perf_counter()
    host.submit(1.0)
    if before == "evict":
        nvme.file.map.flush()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="where the state file goes (default: a temporary directory under /tmp)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        states = {False: build(args, None), True: build(args, directory)}
        file = states[True].offload.nvme.file
        print(
            f"host step of {args.layers} offloaded layers of hidden {args.hidden} (bf16 weights, AdamW, 1 thread): "
            f"{format_bytes(file.used_bytes)} of fp32 mains and moments, file {file.path} on "
            f"{os.path.realpath(directory)}"
        )
        times = {label: [] for label, *_ in SETTINGS}
        for _ in range(args.rounds):
            for label, in_file, before, read_ahead in SETTINGS:
                times[label].append(timed_step(states[in_file], before, read_ahead))
    base = statistics.median(times["RAM"])
    figures = {}
    for label, ts in times.items():
        figures[label] = statistics.median(ts)
        print(f"  {label:<36} {figures[label] * 1e3:8.1f} ms  ({figures[label] / base:.2f}x RAM)")
    print(
        f"  read-ahead / none, from disk: {figures['file, from disk, read ahead'] / figures['file, from disk, no read-ahead']:.2f}"
        f"; disk traffic {2 * file.used_bytes / figures['file, from disk, read ahead'] / 1e9:.2f} GB/s "
        f"(read + write back, {args.rounds} rounds, medians)"
    )
    write_json(args.json, {"seconds": figures, "bytes": file.used_bytes, "rounds": args.rounds})


if __name__ == "__main__":
    main()
