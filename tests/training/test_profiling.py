"""Megatron-LM's profiler flags in the training loop (training/profiling.py, docs/profiling.md):
the trace holds the steps of Megatron's window and nothing else, only --profile-ranks write one,
and what needs CUDA says so once on CPU. The CUDA halves (kernels in the trace, the nsys range,
the memory snapshot) are tests/cuda/test_profiling.py."""

import contextlib
import glob
import io
import json
import os
import types

import pytest
import torch

from megatron_p2r.training import pretrain, profiling
from tests.harness import run_distributed
from tests.helpers import tiny_config

STEP = "megatron_p2r/training/step.py"  # the python_function events of train_step carry its file


def profiled(**values):
    return tiny_config(
        **{"train_iters": 5, "log_interval": 5, "eval_iters": 0, "global_batch_size": 2, "profile": True, **values}
    )


def trace_events(directory) -> list:
    (path,) = glob.glob(os.path.join(str(directory), "rank*.pt.trace.json"))
    with open(path) as fh:
        return json.load(fh)["traceEvents"]


def profiler_steps(events) -> list:
    return sorted(
        int(e["name"].split("#")[1])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    )


def train_steps_traced(events) -> int:
    """How many train_step calls the trace holds (with_stack records each Python call)."""
    return sum(
        e.get("cat") == "python_function" and e["name"].startswith(f"{STEP}(") and "train_step" in e["name"]
        for e in events
    )


@pytest.mark.parametrize("start, end", [(2, 4), (0, 2), (1, 5), (3, 9)])
def test_trace_holds_megatrons_window_only(tmp_path, start, end):
    """Megatron-LM's schedule (wait = start - 1, warmup 1, active = end - start, stepped at the top
    of each pass): ProfilerStep#start .. #end-1, each wrapping the step that makes that iteration;
    with start 0 the window opens before the first step (#0 holds no step). A run of 5 steps that
    ends inside the window (3, 9) writes the steps it made: #3 .. #5."""
    pretrain(
        profiled(
            use_pytorch_profiler=True, profile_step_start=start, profile_step_end=end, tensorboard_dir=str(tmp_path)
        )
    )
    events = trace_events(tmp_path)
    last = min(end, 6)  # train_iters 5: the run's last step is ProfilerStep#5
    assert profiler_steps(events) == list(range(start, last))
    assert train_steps_traced(events) == last - max(start, 1)


def test_a_resumed_run_counts_the_steps_of_this_run(tmp_path):
    """As Megatron-LM's torch profiler, whose schedule starts at 0 in every run: resumed at
    iteration 3, --profile-step-start 1 --profile-step-end 3 traces this run's steps 1 and 2
    (iterations 4 and 5), not iterations 1 and 2."""
    save = str(tmp_path / "ckpt")
    pretrain(profiled(profile=False, train_iters=3, save=save))
    pretrain(
        profiled(
            train_iters=6,
            load=save,
            use_pytorch_profiler=True,
            profile_step_start=1,
            profile_step_end=3,
            tensorboard_dir=str(tmp_path / "tb"),
        )
    )
    events = trace_events(tmp_path / "tb")
    assert profiler_steps(events) == [1, 2] and train_steps_traced(events) == 2


def test_without_tensorboard_dir_the_trace_goes_to_torch_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pretrain(profiled(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2))
    assert profiler_steps(trace_events(tmp_path / "torch_profile")) == [1]


def _two_ranks(rank, world, directory):
    cfg = profiled(
        use_pytorch_profiler=True,
        profile_step_start=1,
        profile_step_end=3,
        profile_ranks=[1],
        tensorboard_dir=directory,
        global_batch_size=4,
        record_memory_history=True,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(cfg)
    return out.getvalue()


def test_only_the_profile_ranks_write_a_trace(tmp_path):
    """2 data-parallel ranks (gloo), --profile-ranks 1: rank 1's trace, nothing from rank 0; the
    last rank alone says that --record-memory-history needs CUDA."""
    outputs = run_distributed(_two_ranks, 2, str(tmp_path))
    traces = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*.pt.trace.json")))
    assert len(traces) == 1 and traces[0].startswith("rank1."), traces
    assert profiler_steps(trace_events(tmp_path)) == [1, 2]
    assert [out.count("profiler trace written") for out in outputs] == [0, 1], outputs
    assert [out.count("needs CUDA") for out in outputs] == [0, 1], outputs


def test_cuda_only_flags_say_so_once_on_cpu(tmp_path, capsys, monkeypatch):
    """--profile without --use-pytorch-profiler (nsys bracketing) and --record-memory-history need
    CUDA: one line each, and no file."""
    monkeypatch.chdir(tmp_path)
    pretrain(profiled(record_memory_history=True, log_interval=1))
    out = capsys.readouterr().out
    assert out.count("needs CUDA") == 2, out
    assert out.count("--profile without --use-pytorch-profiler brackets the steps for nsys") == 1
    assert out.count("--record-memory-history records the CUDA allocator: it needs CUDA") == 1
    assert os.listdir(tmp_path) == []


def test_memory_snapshots_at_the_first_step_and_each_log_interval(monkeypatch):
    """Megatron-LM's training_log dumps at the run's first iteration and every --log-interval, on
    the last rank only (a CUDA device object stands in: nothing here touches CUDA)."""
    paths, dumps = [], []
    monkeypatch.setattr(profiling, "dump_memory_snapshot", paths.append)
    cfg = profiled(profile=False, record_memory_history=True, log_interval=3)
    for rank in (0, 1):
        ps = types.SimpleNamespace(rank=rank, layout=types.SimpleNamespace(world_size=2), device=torch.device("cuda"))
        hooks = profiling.StepProfiler(cfg, ps, first_iteration=4)  # resumed at iteration 4
        for iteration in range(5, 12):
            before = len(paths)
            hooks.before_step(iteration - 1)
            hooks.after_step(iteration)
            dumps += [(rank, iteration)] * (len(paths) - before)
    assert dumps == [(1, 5), (1, 6), (1, 9)] and set(paths) == {"snapshot.pickle"}
