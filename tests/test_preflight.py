"""The pre-flight memory check (planning/preflight.py) counts the dataset's sample indices of a
run of any length: --train-iters, or Megatron-LM's --train-samples (no --train-iters at all)."""
import pytest

from megatron_p2r.config import ConfigError
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.planning.preflight import INDEX_BYTES_PER_SAMPLE, check_memory, rank_memory
from tests.helpers import tiny_config

DATA = dict(mock_data=False, data_path=["corpus"], global_batch_size=8)


def _host(**values) -> int:
    cfg = tiny_config(**DATA, **values)
    return rank_memory(cfg, ParallelPlan.for_world(cfg, 1), 0, "cpu")["host"]


def test_a_sample_based_run_counts_its_samples():
    by_iters, by_samples = _host(train_iters=1000), _host(train_iters=None, train_samples=8000)
    assert by_samples == by_iters
    assert _host(train_iters=None, train_samples=16000) - by_samples == INDEX_BYTES_PER_SAMPLE * 8000


def test_a_sample_based_run_that_does_not_fit_is_refused():
    cfg = tiny_config(**DATA, train_iters=None, train_samples=8000)
    with pytest.raises(ConfigError, match="this run does not fit in memory"):
        check_memory(cfg, ParallelPlan.for_world(cfg, 1), 0, "cpu", host_available=2 ** 16)
