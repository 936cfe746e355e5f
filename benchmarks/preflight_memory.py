"""The memory preflight's CPU estimate against the peak RSS a real run reaches.

    python benchmarks/preflight_memory.py [--seq 1024 2048 4096] [--layers 1] [--hidden 256] [--heads 8]

Each case is a ``pretrain_m6.py`` run of three steps on mock data (fp32, micro-batch 1,
--attention-dropout 0 and Megatron's default 0.1, no hidden dropout) in a process of its own,
with the default glibc allocator. Right after the preflight (``lifecycle.check_memory``) the
child records the preflight's host estimate and its anonymous RSS, and resets the kernel's RSS
high-water mark (``/proc/self/clear_refs``); at the end it reads the mark (``VmHWM``). The
measured peak is the anonymous memory at the mark (the mark minus the file-backed and shared
pages then) minus the anonymous RSS at the preflight: what the run allocated after the check.
File-backed pages (the code of the torch kernels a step first touches, ~38 MiB) are clean and
reclaimable, not what gets a run killed; the RSS peak with them is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import pretrain_m6
from megatron_p2r import lifecycle
from megatron_p2r.planning.preflight import rank_memory

def status_kib(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))

seen = {}
check = lifecycle.check_memory

def measured_check(cfg, plan, rank, device_type, **kwargs):
    check(cfg, plan, rank, device_type, **kwargs)
    seen["estimate"] = rank_memory(cfg, plan, plan.layout.coords(rank).pp, device_type)["host"]
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    seen["rss"] = status_kib("VmRSS") * 1024
    seen["anon"] = status_kib("RssAnon") * 1024

lifecycle.check_memory = measured_check
rc = pretrain_m6.main(sys.argv[2:])
hwm, file, shared = status_kib("VmHWM"), status_kib("RssFile"), status_kib("RssShmem")
print(json.dumps({"rc": rc, "estimate": seen["estimate"], "peak": (hwm - file - shared) * 1024 - seen["anon"],
                  "rss_peak": hwm * 1024 - seen["rss"]}))
"""


def case_flags(
    seq: int, attention_dropout: float, layers: int, hidden: int, heads: int, hidden_dropout: float = 0.0
) -> List[str]:
    return [
        "--mock-data",
        "--vocab-size",
        "1024",
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        str(heads),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "3",
        "--lr",
        "1e-4",
        "--attention-dropout",
        str(attention_dropout),
        "--hidden-dropout",
        str(hidden_dropout),
        "--device",
        "cpu",
        "--log-interval",
        "100",
        "--seed",
        "1",
    ]


def measure(flags: List[str]) -> Dict[str, int]:
    """{"estimate", "peak", "rss_peak"} bytes of one run of ``pretrain_m6.py flags`` in a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("P2R_SKIP_MEMORY_CHECK", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, ROOT, *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"pretrain_m6.py {' '.join(flags)} failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"pretrain_m6.py {' '.join(flags)} exited {result['rc']}: {out.stderr[-2000:]}")
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args(argv)
    print(f"fp32, micro-batch 1, {args.layers} layer(s), hidden {args.hidden}, {args.heads} heads, vocab 1024")
    print(
        "| seq | attention dropout | estimate MiB | measured peak MiB (anonymous) | estimate / measured | "
        "RSS peak MiB |"
    )
    print("|---|---|---|---|---|---|")
    for seq in args.seq:
        for dropout in (0.0, 0.1):
            r = measure(case_flags(seq, dropout, args.layers, args.hidden, args.heads))
            print(
                f"| {seq} | {dropout} | {r['estimate'] / 2**20:.1f} | {r['peak'] / 2**20:.1f} | "
                f"{r['estimate'] / r['peak']:.2f} | {r['rss_peak'] / 2**20:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
