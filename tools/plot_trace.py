"""Draw the timeline of profiler traces: one band per trace file (a rank), the profiled steps
(``ProfilerStep#N``) on top and under them the calls they made, a few levels deep.

    python tools/plot_trace.py DIR/rank0.*.pt.trace.json DIR/rank1.*.pt.trace.json --output trace.png

Reads the Chrome trace that ``torch.profiler``'s TensorBoard handler writes (``.json`` or
``.json.gz``; what ``--profile --use-pytorch-profiler`` writes, docs/profiling.md): the complete
events (``"ph": "X"``) of the thread that ran the steps, nested by their intervals. Python calls
are named by their function (``with_stack`` records them), modules by their class. For a
closer look open the same file in TensorBoard or ui.perfetto.dev. Needs the ``plot`` extra
(matplotlib).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from typing import Dict, List, Tuple

STEP_PREFIX = "ProfilerStep#"
Box = Tuple[float, float, int, str]  # start (ms on the traces' common clock), duration (ms), depth, label


def read_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def short_name(event: dict) -> str:
    """``megatron_p2r/training/step.py(31): train_step`` -> ``train_step``; ``nn.Module: M6Model_0``
    -> ``M6Model``; ``<built-in method wait of ...>`` -> ``wait``; operators keep their names
    (``aten::mm``)."""
    name = str(event.get("name", ""))
    builtin = re.match(r"<built-in (?:method|function) (\w+)", name)
    if builtin:
        return builtin.group(1)
    module = re.match(r"nn\.Module: (\w+?)(_\d+)?$", name)
    if module:
        return module.group(1)
    call = re.match(r".*\(\d+\): (.+)$", name)
    return call.group(1) if call else name


def step_boxes(trace: dict, depth: int) -> List[Box]:
    """The profiled steps and the calls nested in them down to ``depth`` levels, on the thread
    that ran the steps; times in ms on the clock the ranks of one host share (the trace's
    ``baseTimeNanoseconds`` plus each event's ``ts``)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)]
    if not steps:
        return []
    thread = (steps[0].get("pid"), steps[0].get("tid"))
    origin = -float(trace.get("baseTimeNanoseconds", 0)) / 1000  # microseconds
    windows = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in steps]
    inside = [
        e
        for e in events
        if (e.get("pid"), e.get("tid")) == thread
        and any(a <= float(e["ts"]) and float(e["ts"]) + float(e["dur"]) <= b for a, b in windows)
    ]
    inside.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    boxes, open_ends = [], []
    for e in inside:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while open_ends and start >= open_ends[-1]:
            open_ends.pop()
        if open_ends and end > open_ends[-1]:
            continue  # outlives its parent (an asynchronous send's whole life): not a nested call
        if len(open_ends) <= depth:
            boxes.append(((start - origin) / 1000, (end - start) / 1000, len(open_ends), short_name(e)))
        open_ends.append(end)
    return boxes


def plot(traces: Dict[str, List[Box]], depth: int, output: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = depth + 1
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.42 * rows * len(traces)))
    palette = plt.get_cmap("tab20").colors
    colours: Dict[str, tuple] = {}
    origin = min(s for boxes in traces.values() for s, _, _, _ in boxes)
    traces = {name: [(s - origin, d, lvl, label) for s, d, lvl, label in boxes] for name, boxes in traces.items()}
    span = max(s + d for boxes in traces.values() for s, d, _, _ in boxes)
    ms_per_char = span / 260  # a label of 7-point text fits where the bar is wider than its characters
    labels, ticks = [], []
    for band, (name, boxes) in enumerate(traces.items()):
        top = band * (rows + 0.6)
        for start, duration, level, label in boxes:
            key = STEP_PREFIX if label.startswith(STEP_PREFIX) else label
            colour = colours.setdefault(key, palette[len(colours) % len(palette)])
            y = top + level
            ax.broken_barh([(start, duration)], (y, 0.9), facecolors=colour, edgecolor="white", linewidth=0.3)
            if duration > ms_per_char * (len(label) + 2):
                ax.text(start + duration / 2, y + 0.45, label, ha="center", va="center", fontsize=7, clip_on=True)
        labels += [f"{name}: depth {level}" if level else f"{name}: steps" for level in range(rows)]
        ticks += [top + level + 0.45 for level in range(rows)]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("ms from the first profiled step's start (the ranks' common clock)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def band_name(trace: dict, path: str) -> str:
    rank = (trace.get("distributedInfo") or {}).get("rank")
    return f"rank {rank}" if rank is not None else path.rsplit("/", 1)[-1].split(".")[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="trace files (.pt.trace.json[.gz]), one band each")
    parser.add_argument("--output", required=True, help="the PNG to write")
    parser.add_argument("--depth", type=int, default=3, help="levels of calls under the steps")
    parser.add_argument("--title", default="torch.profiler trace: the profiled steps and their calls")
    args = parser.parse_args(argv)
    traces = {}
    for path in args.traces:
        try:
            trace = read_trace(path)
        except (OSError, ValueError) as exc:
            print(f"error: {path}: not a readable trace ({exc})", file=sys.stderr)
            return 2
        boxes = step_boxes(trace, args.depth)
        if not boxes:
            print(f"error: {path}: no {STEP_PREFIX}N event (not a torch.profiler step trace)", file=sys.stderr)
            return 2
        traces[band_name(trace, path)] = boxes
        steps = sorted(label for _, _, level, label in boxes if level == 0)
        print(f"{path}: {', '.join(steps)}; {len(boxes)} events to depth {args.depth}")
    plot(dict(sorted(traces.items())), args.depth, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
