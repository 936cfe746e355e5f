"""The planner's numbers stay what they were: ``tools/plan.py --json`` for a few configurations
against tests/fixtures/planner_golden.json, captured from the planner before it cached its work
per stage structure. Exact equality: caching must not change a single byte or second.

The golden file also holds Narayanan et al.'s 1T configuration (TP 8, PP 64, 3,072 GPUs) and
``benchmarks/memory_per_rank.py --tables``; those take seconds, not milliseconds, so
``benchmarks/planner_speed.py`` checks them, not this test.

When the planner's JSON gains keys or its verdict changes (what fits where: ``fits``,
``problems``, ``tiers``, the host capacity, the exit status), refresh the file with

    python -m tests.planning.test_golden --update

which reruns every case and refuses to write if any other value changed: the numbers stay pinned.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

from tools.plan import main

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "planner_golden.json")
# What --update may change in a case: the verdict, not the numbers behind it.
VERDICT = ("exit", "fits", "problems", "tiers", "host_capacity_per_node", "host_memory_per_node")
CHEAP = [
    "pseudo_pp4_fp32_full_recompute",
    "moe_gqa_tp2_pp2_ep2_sp_interleaved_offload",
    "m6_10t",
    "m6_1t",
    "dense_175b_interleaved_sp",
]


def golden() -> dict:
    with open(GOLDEN, encoding="utf-8") as fh:
        return json.load(fh)


def differences(got, want, path: str = "") -> list:
    """Paths where two JSON values differ (a readable failure instead of a 200-line diff)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got] + [
            f"{path}.{k}: unexpected" for k in got if k not in want
        ]
        for k in want:
            if k in got:
                out += differences(got[k], want[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


@pytest.mark.parametrize("name", CHEAP)
def test_plan_equals_golden(name, capsys):
    case = golden()["cases"][name]
    assert main(case["argv"] + ["--json"]) == case["exit"]
    out = json.loads(capsys.readouterr().out)
    problems = differences({"plans": out["plans"], "p2r": out["p2r"]}, {"plans": case["plans"], "p2r": case["p2r"]})
    assert not problems, "\n".join(problems[:20])


def test_golden_covers_what_it_claims():
    """The cheap cases keep covering what made them worth keeping: both phases, PP with a
    pseudo slot on several stages, interleaving, EP, offload, bf16, fp16 (the m6 files) and fp32."""
    cases = golden()["cases"]
    assert set(CHEAP) < set(cases) and "narayanan_1t" in cases
    argv = " ".join(" ".join(cases[n]["argv"]) for n in CHEAP)
    for flag in (
        "--num-layers-per-virtual-pipeline-stage",
        "--expert-model-parallel-size",
        "--cpu-offload-layers",
        "--sequence-parallel",
        "--bf16",
        "--recompute-granularity full",
        "--share-pattern cycle:2",
    ):
        assert flag in argv, flag
    assert all(set(cases[n]["plans"]) == {"pseudo", "real"} for n in cases)


def _run(argv: list) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv + ["--json"])
    data = json.loads(out.getvalue())
    return {"argv": argv, "exit": status, "plans": data["plans"], "p2r": data["p2r"]}


def _is_verdict(path: str) -> bool:
    return any(path.endswith(f".{k}") or f".{k}." in path or f".{k}[" in path for k in VERDICT)


def update() -> int:
    """Rerun every case; write the file only if the values that are not verdict keys are unchanged."""
    data = golden()
    changed = []
    for name, case in data["cases"].items():
        fresh = _run(case["argv"])
        changed += [
            f"{name}{d}"
            for d in differences(fresh, case)
            if not d.endswith(": unexpected") and not _is_verdict(d.split(": ")[0])
        ]
        data["cases"][name] = fresh
    if changed:
        print("error: numbers differ from the golden file, not written:\n" + "\n".join(changed[:40]), file=sys.stderr)
        return 1
    with open(GOLDEN, "w", encoding="utf-8") as fh:
        json.dump(data, fh, separators=(",", ":"))
    print(f"updated {GOLDEN}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.planning.test_golden --update")
    sys.exit(update())
