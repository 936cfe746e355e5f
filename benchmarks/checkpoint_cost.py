"""What a checkpoint costs at scale, from the planner (``planning/checkpoint_cost.py``): the
10T and 1T examples (their README commands; 10T's real phase with Adafactor too) and GPT-3 175B at TP 8, PP 8 on 512 A100-80GB
with the distributed optimizer, fully parallel and with one writer per shard.

    python benchmarks/checkpoint_cost.py

Prints a markdown table (docs/checkpoint.md) at the planner's default filesystem bandwidths
(100 GB/s in all, the node's network per node); ``p2r-plan ... --fs-write-bw B
--fs-node-write-bw B`` plans another filesystem.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import List, Optional, Sequence

from tools.plan import main as plan_main

GiB = 2**30


def _example(name: str, real: str = "real.yaml") -> List[str]:
    return [
        "--config",
        f"examples/{name}/model.yaml",
        "--pseudo-config",
        f"examples/{name}/pseudo.yaml",
        "--real-config",
        f"examples/{name}/{real}",
        "--world-size",
        "512",
        "--gpu",
        "V100-32GB",
        "--token-budget",
        "50B",
    ]


GPT3_175B = [
    "--num-layers",
    "96",
    "--hidden-size",
    "12288",
    "--num-attention-heads",
    "96",
    "--seq-length",
    "2048",
    "--vocab-size",
    "51200",
    "--tensor-model-parallel-size",
    "8",
    "--pipeline-model-parallel-size",
    "8",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "512",
    "--bf16",
    "--sequence-parallel",
    "--recompute-activations",
    "--use-distributed-optimizer",
    "--world-size",
    "512",
    "--gpu",
    "A100-80GB",
    "--p2r-phase",
    "real",
]

CASES = [
    ("M6-10T", _example("m6_10t"), ("pseudo", "real")),
    ("M6-10T Adafactor", _example("m6_10t", "real_lean.yaml") + ["--host-memory", "192GiB"], ("real",)),
    ("M6-1T", _example("m6_1t"), ("pseudo", "real")),
    ("GPT-3 175B", GPT3_175B, ("real",)),
    ("GPT-3 175B", GPT3_175B + ["--no-ckpt-fully-parallel-save"], ("real",)),
]


def _plans(argv: List[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(argv + ["--json"])
    return json.loads(out.getvalue())["plans"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    print(
        "| model | phase | writers | checkpoint TB | GiB per rank | GiB per node | write s | stall s | "
        "stall s async | host GiB during save | host GiB async |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, args, phases in CASES:
        plans = _plans(args)
        for phase in phases:
            c = plans[phase]["checkpoint"]
            stall, host = c["stall_s"], c["host_bytes_during_save"]
            print(
                f"| {name} | {phase} | {c['writers'].replace('_', ' ')} | {c['total_bytes'] / 1e12:.3g} | "
                f"{c['rank_bytes_max'] / GiB:.2f} | {c['node_bytes_max'] / GiB:.1f} | {c['write_s']:.1f} | "
                f"{stall['sync']:.1f} | {stall['async']:.2f} | {host['sync'] / GiB:.2f} | {host['async'] / GiB:.2f} |"
            )


if __name__ == "__main__":
    main()
