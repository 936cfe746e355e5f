"""Every combination of the optimizer step's settings the old code refused is refused by the
step plan's table, with the same error, and nothing else is.

``tests/fixtures/old_step_refusals.json`` records, for each combination of ``combinations()``,
the error ``validate`` raised before the step plan existed (commit cb81f46, where the refusals
were spread over config/offload.py, config/validation.py and config/train.py); it was written by
``python -m tests.config.test_step_refusals --record`` on that commit.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from typing import Dict, Iterator, Optional, Tuple

import pytest

from megatron_p2r.config import ConfigError, validate
import megatron_p2r.config.step_plan as plan_module
from tests.helpers import tiny_config

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "old_step_refusals.json")

PLACEMENTS = {
    "device": {},
    "host": dict(cpu_offload_layers="1"),
    "staged": dict(cpu_offload_layers="1", cpu_offload_what="optimizer"),
}
PRECISIONS = {
    "fp32": {},
    "bf16": dict(bf16=True),
    "fp16": dict(fp16=True),
    "bf16-fp16-mains": dict(bf16=True, main_params_dtype="fp16"),
    "fp16-fp16-mains": dict(fp16=True, main_params_dtype="fp16"),
    "fp32-fp16-mains": dict(main_params_dtype="fp16"),
}
MOMENTS = {"fp32": {}, "exp_avg-bf16": dict(exp_avg_dtype="bf16"), "exp_avg_sq-bf16": dict(exp_avg_sq_dtype="bf16")}
SWITCHES = ("overlap", "delayed", "nvme", "threads", "distributed")
# Errors whose wording improved since the recording (same meaning): the old text -> the new one's pattern.
IMPROVED = {
    "--exp-avg-dtype / --exp-avg-sq-dtype: --optimizer adafactor keeps no moments of the weights' size (its "
    "factored statistics are fp32); leave them fp32": r"(--exp-avg-dtype bf16|--exp-avg-sq-dtype bf16): --optimizer adafactor keeps no moments of the weights' "
    r"size \(its factored statistics are fp32\); leave them fp32"
}


def combinations() -> Iterator[Tuple[str, dict]]:
    """(a name, the flags) of every combination of placement, host-step variant, precision,
    optimizer kind and moment dtypes."""
    for place, precision, kind, moments, *switches in itertools.product(
        PLACEMENTS, PRECISIONS, ("adam", "lion", "adafactor"), MOMENTS, *[(False, True)] * len(SWITCHES)
    ):
        on = dict(zip(SWITCHES, switches, strict=True))
        flags = {
            **PLACEMENTS[place],
            **PRECISIONS[precision],
            **MOMENTS[moments],
            "optimizer": kind,
            "overlap_cpu_optimizer_d2h_h2d": on["overlap"],
            "cpu_offload_delayed_param_update": on["delayed"],
            "cpu_offload_optimizer_nvme_path": "/nvme" if on["nvme"] else None,
            "host_optimizer_threads": 2 if on["threads"] else 1,
            "use_distributed_optimizer": on["distributed"],
        }
        if precision != "fp32" and "mains" in precision or moments != "fp32":
            flags["use_precision_aware_optimizer"] = True
        name = "/".join([place, precision, kind, moments] + [s for s in SWITCHES if on[s]])
        yield name, flags


def verdict(flags: dict) -> Optional[str]:
    """The error ``validate`` raises for ``flags``, None when it accepts them."""
    try:
        validate(tiny_config(**flags), 1)
    except ConfigError as e:
        return str(e)
    return None


def _recorded() -> Dict[str, str]:
    with open(FIXTURE, encoding="utf-8") as f:
        recorded = json.load(f)
    return {name: recorded["messages"][i] for name, i in recorded["refused"].items()}


# Refusals lifted since the recording: --host-optimizer-threads sets the host kernels' threads of
# every host step, serial too (issue 37), so those combinations give what they give with one thread.
LIFTED = (
    "--host-optimizer-threads sets the threads of the overlapped host step: it needs --overlap-cpu-optimizer-d2h-h2d"
)


def _expected(name: str, recorded: Dict[str, str]) -> Optional[str]:
    old = recorded.get(name)
    return recorded.get(name.replace("/threads", "")) if old == LIFTED else old


def _same(old: Optional[str], new: Optional[str]) -> bool:
    if old is None or new is None:
        return old == new
    return new == old or (old in IMPROVED and re.fullmatch(IMPROVED[old], new) is not None)


def _differences() -> Dict[str, tuple]:
    recorded = _recorded()
    assert len(recorded) > 1000  # the fixture is the enumeration, not a sample of it
    return {
        name: (_expected(name, recorded), got)
        for name, flags in combinations()
        if not _same(_expected(name, recorded), got := verdict(flags))
    }


@pytest.mark.slow
def test_the_step_plan_refuses_what_the_old_code_refused_and_nothing_more():
    wrong = _differences()
    assert not wrong, f"{len(wrong)} combinations differ (old, new), e.g. {dict(itertools.islice(wrong.items(), 3))}"


@pytest.mark.parametrize("row", [r.name for r in plan_module.REFUSALS])
def test_each_row_of_the_table_is_needed(row, monkeypatch):
    """Without any one row, a combination the old code refused with that row's error is accepted
    (or refused for another reason)."""
    message = next(r.message for r in plan_module.REFUSALS if r.name == row)
    theirs = {name for name, old in _recorded().items() if old == message}
    assert theirs, f"no recorded combination was refused with {row}'s error"
    monkeypatch.setattr(plan_module, "REFUSALS", tuple(r for r in plan_module.REFUSALS if r.name != row))
    assert any(verdict(flags) != message for name, flags in combinations() if name in theirs)


def _record() -> None:
    messages: Dict[str, int] = {}
    refused = {}
    for name, flags in combinations():
        message = verdict(flags)
        if message is not None:
            refused[name] = messages.setdefault(message, len(messages))
    with open(FIXTURE, "w", encoding="utf-8") as f:
        json.dump({"messages": list(messages), "refused": refused}, f, indent=0, sort_keys=True)
    print(f"{len(refused)} refused combinations, {len(messages)} distinct errors -> {FIXTURE}")


if __name__ == "__main__" and "--record" in sys.argv:
    _record()
elif __name__ == "__main__":
    pytest.main([__file__, "-q"])
