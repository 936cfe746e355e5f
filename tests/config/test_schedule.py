"""The schedule plan: every combination of stages, --pipeline-schedule, model chunks and the two
overlap flags either chooses one schedule or is refused, here and nowhere else."""

from __future__ import annotations

import itertools

import pytest

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.config.schedule import (
    COMBINED,
    GPIPE,
    INTERLEAVED,
    NO_PIPELINING,
    ONE_F_ONE_B,
    SchedulePlan,
    choose_schedule,
    schedule_plan,
)
from tests.helpers import tiny_config

REFUSED = "refused"


def expected(stages: int, schedule: str, chunks: int, overlap_p2p: bool, overlap_moe: bool):
    """The table of config/schedule.py's docstring, written out case by case."""
    if stages == 1:
        return SchedulePlan(COMBINED if overlap_moe else NO_PIPELINING, 1, 1)
    if schedule == "gpipe":
        return REFUSED if chunks > 1 or overlap_moe else SchedulePlan(GPIPE, stages, 1)
    if overlap_moe:
        return REFUSED if chunks > 1 and overlap_p2p else SchedulePlan(COMBINED, stages, chunks)
    if chunks > 1:
        return SchedulePlan(INTERLEAVED, stages, chunks, posts_receives_ahead=overlap_p2p)
    return SchedulePlan(ONE_F_ONE_B, stages, 1)


CASES = [
    case
    for case in itertools.product((1, 2, 4), ("1f1b", "gpipe"), (1, 2), (False, True), (False, True))
    if case[0] > 1 or case[2] == 1
]  # one stage has one chunk (config/parallel.py refuses more)


@pytest.mark.parametrize("stages,schedule,chunks,overlap_p2p,overlap_moe", CASES)
def test_every_combination_chooses_its_schedule_or_is_refused(stages, schedule, chunks, overlap_p2p, overlap_moe):
    want = expected(stages, schedule, chunks, overlap_p2p, overlap_moe)
    if want == REFUSED:
        with pytest.raises(ConfigError):
            choose_schedule(stages, schedule, chunks, overlap_p2p, overlap_moe)
    else:
        assert choose_schedule(stages, schedule, chunks, overlap_p2p, overlap_moe) == want


def test_the_serial_schedule_of_the_combined_one():
    """Evaluation runs forwards only: the combined schedule's serial twin."""
    assert SchedulePlan(COMBINED, 1, 1).serial == SchedulePlan(NO_PIPELINING, 1, 1)
    assert SchedulePlan(COMBINED, 2, 1).serial == SchedulePlan(ONE_F_ONE_B, 2, 1)
    assert SchedulePlan(COMBINED, 2, 2).serial == SchedulePlan(INTERLEAVED, 2, 2)
    plain = SchedulePlan(INTERLEAVED, 2, 2, posts_receives_ahead=True)
    assert plain.serial is plain


MOE = dict(num_experts=4, expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(num_layers_per_virtual_pipeline_stage=1, pipeline_schedule="gpipe"), "interleaving is a 1F1B schedule"),
        (dict(pipeline_schedule="gpipe", **MOE), "needs --pipeline-schedule 1f1b"),
        (dict(num_layers_per_virtual_pipeline_stage=1, **MOE), "pass --no-overlap-p2p-communication"),
        (dict(overlap_moe_expert_parallel_comm=True), r"needs --num-experts and --expert-model-parallel-size > 1"),
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2, **MOE),
            "--recompute-num-layers 1",
        ),
        (dict(compile=True, **MOE), "conflicts with --compile"),
    ],
)
def test_validation_refuses_through_the_schedule_plan(flags, message):
    cfg = tiny_config(**{"num_layers": 4, "pipeline_model_parallel_size": 2, **flags})
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=4)
    with pytest.raises(ConfigError, match=message):
        schedule_plan(cfg)


def test_accepted_configs_get_the_plan_the_runtime_and_planner_read():
    cfg = tiny_config(num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    validate(cfg, world_size=2)
    assert schedule_plan(cfg) == SchedulePlan(INTERLEAVED, 2, 2, posts_receives_ahead=True)
    moe = tiny_config(num_layers=4, pipeline_model_parallel_size=2, **MOE)
    validate(moe, world_size=4)
    assert schedule_plan(moe) == SchedulePlan(COMBINED, 2, 1)
