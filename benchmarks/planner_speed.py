"""CPU seconds the planner takes for Narayanan et al.'s 1T configuration and for the whole check
of Megatron-LM's published tables, and whether its numbers are still the recorded ones.

    python benchmarks/planner_speed.py [--skip-tables]

1T: ``tools/plan.py --json`` for 128 layers of hidden 25600 (160 heads), sequence 2048, vocab
51200, TP 8, PP 64, 3,072 A100-80GB, global batch 3,072, --fp16 (both phases: the pseudo and
the real model), compared with the golden file of the planner's tests. Tables:
``benchmarks/memory_per_rank.py --tables`` (19 configurations, each with and without the
distributed optimizer), compared line by line with the same file. CPU time
(``time.process_time``) in a fresh process per measurement, after the imports: neither other
load on the machine nor a schedule cached by the other measurement counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory_per_rank import tables_mode  # noqa: E402
from tools.plan import main as plan  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "fixtures", "planner_golden.json")


def _tables() -> None:
    tables_mode(False)


def _timed(fn, *args) -> tuple:
    """(CPU seconds, stdout) of ``fn(*args)`` in this process."""
    out = io.StringIO()
    start = time.process_time()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return time.process_time() - start, out.getvalue()


def _fresh(fn, *args) -> tuple:
    """``_timed`` in a new process (spawned: it imports this module, so the planner is loaded
    before the clock starts): nothing cached by an earlier measurement."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_timed, (fn, *args))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tables", action="store_true", help="Time the 1T plan only.")
    args = parser.parse_args(argv)
    with open(GOLDEN, encoding="utf-8") as fh:
        golden = json.load(fh)
    case = golden["cases"]["narayanan_1t"]
    seconds, out = _fresh(plan, case["argv"] + ["--json"])
    data = json.loads(out)
    same = {"plans": data["plans"], "p2r": data["p2r"]} == {"plans": case["plans"], "p2r": case["p2r"]}
    print(
        f"1T (TP 8, PP 64, 3,072 GPUs, --fp16), both phases: {seconds:.2f} CPU s; numbers "
        f"{'identical to' if same else 'DIFFERENT from'} tests/fixtures/planner_golden.json"
    )
    if not args.skip_tables:
        seconds, out = _fresh(_tables)
        same = out.splitlines() == golden["memory_per_rank_tables"]
        print(
            f"memory_per_rank.py --tables (19 configurations x 2): {seconds:.2f} CPU s; output "
            f"{'identical to' if same else 'DIFFERENT from'} tests/fixtures/planner_golden.json"
        )


if __name__ == "__main__":
    main()
