"""Megatron-LM's profiler flags on CUDA, through ``pretrain`` (docs/profiling.md): the torch
profiler's trace holds CUDA kernels of the chosen steps only; without --use-pytorch-profiler the
steps are bracketed by cudaProfilerStart/Stop with autograd's NVTX ranges on in between; with
--record-memory-history the last rank dumps a snapshot with the allocator's history."""

from tests.cuda.probe import skip_without_cuda

skip_without_cuda()

import glob  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_p2r.training import loop, pretrain  # noqa: E402

pytestmark = pytest.mark.cuda

PROFILED = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=1000,
    micro_batch_size=2,
    global_batch_size=2,
    train_iters=5,
    log_interval=2,
    eval_iters=0,
    profile=True,
    profile_step_start=2,
    profile_step_end=4,
)


def test_pytorch_profiler_traces_cuda_kernels_of_the_chosen_steps(lane, tmp_path, record_property):
    lane.needs_cuda("CUDA kernels in the torch profiler's trace")
    pretrain(lane.config({**PROFILED, "use_pytorch_profiler": True, "tensorboard_dir": str(tmp_path)}))
    (path,) = glob.glob(str(tmp_path / "rank0.*.pt.trace.json"))
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})
    kernels = sum(str(e.get("cat", "")).lower() == "kernel" for e in events)
    record_property("trace", {"steps": steps, "kernels": kernels})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert kernels > 0


def test_nsys_range_brackets_steps_after_start_to_end(lane, monkeypatch):
    """Megatron-LM's nsys window: cudaProfilerStart at the top of the pass after iteration 2,
    cudaProfilerStop after iteration 4; autograd's NVTX ranges are emitted in between."""
    lane.needs_cuda("cudaProfilerStart/Stop")
    events = []
    start, stop, step = torch.cuda.profiler.start, torch.cuda.profiler.stop, loop.train_step
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: (events.append("start"), start()))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: (stop(), events.append("stop")))

    def counted_step(state, microbatches):
        events.append(("nvtx" if torch.autograd._profiler_enabled() else "step", state.iteration + 1))
        return step(state, microbatches)

    monkeypatch.setattr(loop, "train_step", counted_step)
    pretrain(lane.config(PROFILED))
    assert events == [("step", 1), ("step", 2), "start", ("nvtx", 3), ("nvtx", 4), "stop", ("step", 5)]


def test_memory_snapshot_holds_the_allocators_history(lane, tmp_path, record_property):
    lane.needs_cuda("the CUDA allocator's history")
    path = tmp_path / "snapshots" / "snapshot.pickle"
    try:
        pretrain(lane.config({**PROFILED, "record_memory_history": True, "memory_snapshot_path": str(path)}))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as fh:
        snapshot = pickle.load(fh)  # the test's own file, written by torch.cuda.memory._dump_snapshot
    history = [e for trace in snapshot["device_traces"] for e in trace]
    frames = {f["filename"] for e in history for f in e.get("frames", [])}
    record_property("snapshot", {"segments": len(snapshot["segments"]), "events": len(history)})
    assert snapshot["segments"] and any(e["action"] == "alloc" for e in history)
    assert any("megatron_p2r/model" in name for name in frames)  # recording began before the model was built
