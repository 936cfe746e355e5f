"""The planner's numbers stay what they were: ``tools/plan.py --json`` for a few configurations
against tests/fixtures/planner_golden.json, captured from the planner before it cached its work
per stage structure. Exact equality: caching must not change a single byte or second.

The golden file also holds Narayanan et al.'s 1T configuration (TP 8, PP 64, 3,072 GPUs) and
``benchmarks/memory_per_rank.py --tables``; those take seconds, not milliseconds, so
``benchmarks/planner_speed.py`` checks them, not this test.
"""
from __future__ import annotations

import json
import os

import pytest

from tools.plan import main

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "planner_golden.json")
CHEAP = ["pseudo_pp4_fp32_full_recompute", "moe_gqa_tp2_pp2_ep2_sp_interleaved_offload", "m6_10t", "m6_1t",
         "dense_175b_interleaved_sp"]


def golden() -> dict:
    with open(GOLDEN, encoding="utf-8") as fh:
        return json.load(fh)


def differences(got, want, path: str = "") -> list:
    """Paths where two JSON values differ (a readable failure instead of a 200-line diff)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got] + \
              [f"{path}.{k}: unexpected" for k in got if k not in want]
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
    for flag in ("--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size", "--cpu-offload-layers",
                 "--sequence-parallel", "--bf16", "--recompute-granularity full", "--share-pattern cycle:2"):
        assert flag in argv, flag
    assert all(set(cases[n]["plans"]) == {"pseudo", "real"} for n in cases)
