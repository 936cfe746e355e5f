"""The planner's answer for context parallelism (docs/scale.md, "Context parallelism in the
plan"): a Llama-3-8B-shaped model (docs/scale.md's L3 flags) on 8 nodes of 8 H100-80GB at 8k,
32k and 128k tokens with CP 1, 2, 4, 8, and the M6-10T shape (examples/m6_10t, real phase) on
512 H100-80GB, each row one ``tools/plan.py --json`` run. Prints a markdown table.

    PYTHONPATH=. python benchmarks/context_parallel_plan.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tools.plan import main  # noqa: E402

L3 = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --vocab-size 128256 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --bf16 --micro-batch-size 1 --global-batch-size 128 "
    "--tensor-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer --world-size 64"
).split()
M6 = "--config examples/m6_10t/model.yaml examples/m6_10t/real.yaml --world-size 512 --micro-batch-size 1 --global-batch-size 512".split()
LENGTHS = (8192, 32768, 131072)
GIB = 2**30


def row(name: str, argv: List[str], tokens: int, cp: int) -> str:
    """One plan as a table row: what it prints, or the error line it refuses with."""
    out, err = io.StringIO(), io.StringIO()
    full = argv + ["--seq-length", str(tokens), "--max-position-embeddings", str(tokens)]
    full += ["--context-parallel-size", str(cp), "--gpu", "H100-80GB", "--p2r-phase", "real", "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(full)
    if status == 2:
        return f"| {name} | {tokens:,} | {cp} | refused: {err.getvalue().strip().removeprefix('error: ')} |||||"
    plan = json.loads(out.getvalue())["plans"]["real"]
    stage = max(plan["stages"], key=lambda s: s["device_total"])
    t = stage["time_s"]
    over = [f"{v['tier']} +{v['over'] / GIB:.1f} GiB" for v in plan["tiers"].values() if not v["fits"]]
    return (
        f"| {name} | {tokens:,} | {cp} | {'no: ' + ', '.join(over) if over else 'yes'} | {stage['device_total'] / GIB:.1f} "
        f"| {stage['device']['activations'] / GIB:.1f} | {plan['step_time_s']:.2f} "
        f"| {t['cp_per_microbatch'] * 1e3:.1f} | {t['cp_exposed_per_microbatch'] * 1e3:.1f} |"
    )


def table() -> List[str]:
    lines = [
        "| model | tokens | CP | fits | GiB per rank | of which activations | step s | ring ms per micro-batch | exposed ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens in LENGTHS:
        lines += [row("Llama-3-8B-like, TP 8 + SP", L3, tokens, cp) for cp in (1, 2, 4, 8)]
    for tokens in LENGTHS:
        lines += [row("M6-10T real, EP 512", M6, tokens, cp) for cp in (1, 2, 4, 8)]
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
