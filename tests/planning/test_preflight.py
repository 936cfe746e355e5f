"""The pre-flight memory check (planning/preflight.py) counts the dataset's sample indices of a
run of any length: --train-iters, or Megatron-LM's --train-samples (no --train-iters at all);
its CPU estimate against the peak a real run reaches, and a run too large for its cgroup."""

import importlib.util
import os

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
        check_memory(cfg, ParallelPlan.for_world(cfg, 1), 0, "cpu", host_available=2**16)


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "preflight_memory", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "preflight_memory.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])
def test_cpu_estimate_is_within_25_percent_of_the_measured_peak(attention_dropout):
    """A real run (seq 1024, one layer, hidden 256, 8 heads) in a process of its own: the
    anonymous memory it takes after the check against the check's estimate. With dropout CPU
    runs SDPA's math kernel (three fp32 [8, 1024, 1024] tensors); the estimate used to count a
    fused kernel's log-sum-exp instead and came out at a quarter of the peak.
    docs/reliability.md has seq 1024-4096 (benchmarks/preflight_memory.py)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the RSS high-water mark")
    bench = _benchmark()
    r = bench.measure(bench.case_flags(1024, attention_dropout, layers=1, hidden=256, heads=8))
    assert abs(r["estimate"] / r["peak"] - 1) < 0.25, r


def test_a_run_too_large_for_its_cgroup_ends_with_an_error_line(tmp_path, monkeypatch, capsys):
    """A nested cgroup with 180 MiB of headroom: the run with attention dropout at seq 1024
    needs ~240 MiB (measured ~260) and stops at the preflight with an error: line, where the
    old estimate (~70 MiB, no s x s) let it start and be killed."""
    import pretrain_m6
    from megatron_p2r.planning import preflight
    from megatron_p2r.planning.host_memory import available_host_memory
    from tests.planning.test_host_memory import fake_host

    proc, cgroup = fake_host(
        tmp_path, ["0::/job/step"], {"job/memory.max": f"{180 * 2**20}\n", "job/memory.current": "0\n"}
    )
    monkeypatch.setattr(preflight, "available_host_memory", lambda: available_host_memory(proc, cgroup))
    monkeypatch.delenv(preflight.SKIP_ENV, raising=False)
    rc = pretrain_m6.main(_benchmark().case_flags(1024, 0.1, layers=1, hidden=256, heads=8))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "error: this run does not fit in memory: it needs at least" in err and "180.0 MiB available" in err, err
