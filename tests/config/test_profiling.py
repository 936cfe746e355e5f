"""Megatron-LM's profiler flags as config fields (config/profiling.py): its defaults, its
parsing, and the windows and ranks a run cannot profile refused by name."""

import pytest

from megatron_p2r.arguments import parse_launch
from megatron_p2r.config import ConfigError, validate
from tests.helpers import tiny_config

BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def test_megatrons_flags_parse_to_the_profiling_section():
    cfg, no_effect = parse_launch(
        BASE + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-ranks", "0", "1"]
    )
    p = cfg.profiling
    assert (p.profile, p.use_pytorch_profiler, p.profile_step_start, p.profile_step_end) == (True, True, 3, 12)
    assert p.profile_ranks == [0, 1] and no_effect == []
    defaults = parse_launch(BASE)[0].profiling
    assert (defaults.profile_ranks, defaults.memory_snapshot_path) == ([0], "snapshot.pickle")


@pytest.mark.parametrize(
    "values, message",
    [
        (
            dict(profile_step_start=4, profile_step_end=4),
            r"--profile-step-end \(4\) must be greater than --profile-step-start \(4\)",
        ),
        (dict(profile_ranks=[0, 2]), "--profile-ranks 2: this run has ranks 0 to 0"),
    ],
)
def test_a_window_or_rank_that_profiles_nothing_is_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(profile=True, **values), 1)
    validate(tiny_config(**values), 1)  # without --profile they ask for nothing
