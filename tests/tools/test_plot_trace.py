"""tools/plot_trace.py: the steps of a torch.profiler trace and their nested calls, on the ranks'
common clock; a file without steps is refused with one error line."""

import json

from tools import plot_trace


def event(name, ts, dur, cat="python_function", tid=1):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


TRACE = {
    "baseTimeNanoseconds": 1_000_000,  # 1000 us
    "traceEvents": [
        event("megatron_p2r/training/loop.py(120): train", 0, 100),  # outside every step: left out
        event("ProfilerStep#2", 10, 40, cat="user_annotation"),
        event("megatron_p2r/training/step.py(31): train_step", 11, 30),
        event("nn.Module: M6Model_0", 12, 10),
        event("gloo:send", 25, 20, cat="cpu_op"),  # outlives its parent (train_step): not a nested call
        event("<built-in method wait of pybind11_object at 0x1>", 30, 5),
        event("aten::mm", 13, 2, cat="cpu_op", tid=2),  # another thread
    ],
}


def test_steps_and_nested_calls_on_the_common_clock():
    boxes = plot_trace.step_boxes(TRACE, depth=2)
    assert [(start, duration, depth, label) for start, duration, depth, label in boxes] == [
        (1.01, 0.04, 0, "ProfilerStep#2"),
        (1.011, 0.03, 1, "train_step"),
        (1.012, 0.01, 2, "M6Model"),
        (1.03, 0.005, 2, "wait"),
    ]
    assert plot_trace.step_boxes(TRACE, depth=0) == boxes[:1]


def test_draws_a_png_and_refuses_a_trace_without_steps(tmp_path, capsys):
    good, bad, png = tmp_path / "rank0.1.pt.trace.json", tmp_path / "other.json", tmp_path / "t.png"
    good.write_text(json.dumps(TRACE))
    bad.write_text(json.dumps({"traceEvents": [event("x", 0, 1)]}))
    assert plot_trace.main([str(good), "--output", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot_trace.main([str(good), str(bad), "--output", str(png)]) == 2
    assert f"error: {bad}: no ProfilerStep#N event" in capsys.readouterr().err
