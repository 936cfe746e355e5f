"""Do host-to-device copies overlap compute in a profiler trace? (pure Python, no torch)

Reads the Chrome trace that ``torch.profiler`` exports: complete events (``"ph": "X"``) with a
start ``ts`` and a ``dur`` in microseconds, kernels in category ``kernel`` and copies in
``gpu_memcpy`` (names such as ``Memcpy HtoD (Pinned -> Device)``), each with its CUDA stream
in ``args.stream``. A copy overlaps compute for the part of its interval covered by kernels
running on *other* streams — what a side-stream prefetch is for.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Tuple

Interval = Tuple[float, float]


def _union(intervals: List[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(interval: Interval, union: List[Interval]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def _streams(streams) -> list:
    """Stream ids in order (integers as numbers; anything else after them, as text)."""
    return sorted(set(streams), key=lambda s: (0, s, "") if isinstance(s, int) else (1, 0, str(s)))


def stream_overlap(trace: dict) -> Dict[str, object]:
    """Copies host-to-device, their time, and how much of it kernels on other streams covered."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels: Dict[int, List[Interval]] = {}
    copies = []
    for e in events:
        cat, stream = str(e.get("cat", "")).lower(), e.get("args", {}).get("stream")
        interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "kernel":
            kernels.setdefault(stream, []).append(interval)
        elif cat == "gpu_memcpy" and "htod" in str(e.get("name", "")).lower():
            copies.append((stream, interval))
    compute_elsewhere = {
        s: _union([i for other, ivs in kernels.items() if other != s for i in ivs])
        for s in {stream for stream, _ in copies}
    }
    copy_us = sum(b - a for _, (a, b) in copies)
    overlap_us = sum(_covered(interval, compute_elsewhere[stream]) for stream, interval in copies)
    return {
        "h2d_copies": len(copies),
        "h2d_us": copy_us,
        "overlap_us": overlap_us,
        "overlap_fraction": overlap_us / copy_us if copy_us else 0.0,
        "copy_streams": _streams(s for s, _ in copies),
        "kernel_streams": _streams(kernels),
        "categories": dict(Counter(str(e.get("cat")) for e in events)),
    }
