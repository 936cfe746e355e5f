"""The harness of the property-based fuzz (test_fuzz.py): run an entry point in this process on
one generated case and hold it to the contract of docs/reliability.md.

Each case gets its own directory (the process's working directory while it runs). The case must
end in success (exit 0) or in exit 2 with exactly one ``error:`` line, never a traceback; within
``TIME_LIMIT`` seconds (SIGALRM interrupts a case that blocks, a FIFO opened for instance); with
the process's peak RSS under ``RSS_BOUND``; and without opening any file outside its directory
other than the interpreter's and the project's own modules and /proc, /sys (a ``sys.addaudithook``
sees every open, mkdir, rename and removal), or writing anything outside it.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import resource
import shutil
import signal
import sys
import sysconfig
import traceback
from typing import Callable, Dict, List, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIME_LIMIT = 20  # seconds per case (a success trains one tiny step in ~30 ms)
RSS_MARGIN = 1024 * 2**20  # the peak RSS may grow by at most this over the fuzz
CATEGORIES = ("generated", "succeeded", "clear error", "other")
TALLY: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# category -> error messages, their paths and numbers blanked (how varied the refusals are)
MESSAGES: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_READ_ONLY_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        sys.prefix,
        sys.base_prefix,
        sysconfig.get_paths()["stdlib"],
        ROOT,
        "/proc",
        "/sys",
        os.path.dirname(torch.__file__),
    }
)
_WRITE_EVENTS = {
    "os.mkdir",
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "os.unlink",
    "shutil.rmtree",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.chmod",
    "os.mkfifo",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class CaseTimeout(Exception):
    """A case ran past TIME_LIMIT."""


class _Watch:
    """The audit hook's state: the case directory, and what the case touched outside it."""

    case_dir = None
    violations: List[str] = []
    installed = False


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inside(path: str, case_dir: str) -> bool:
    return path == case_dir or path.startswith(case_dir + os.sep)


def _audit(event: str, args) -> None:
    case_dir = _Watch.case_dir
    if case_dir is None or not (event == "open" or event in _WRITE_EVENTS):
        return
    paths = [a for a in args[:2] if isinstance(a, (str, bytes))] if event != "open" else args[:1]
    for raw in paths:
        if not isinstance(raw, (str, bytes)):
            continue  # an open of a file descriptor
        path = os.path.realpath(os.fsdecode(raw))
        if _inside(path, case_dir):
            continue
        writing = (
            event != "open"
            or (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
            or (args[1] is None and isinstance(args[2], int) and args[2] & _WRITE_FLAGS)
        )
        if writing or not path.startswith(_READ_ONLY_ROOTS):
            _Watch.violations.append(f"{event} {path}" + (" (write)" if writing else ""))


def start(rss_margin: int = RSS_MARGIN) -> int:
    """Install the audit hook (once per process); the RSS bound of the fuzz, in bytes."""
    if not _Watch.installed:
        sys.addaudithook(_audit)
        _Watch.installed = True
    return _peak_rss() + rss_margin


def _on_alarm(signum, frame):
    raise CaseTimeout(f"the case ran past {TIME_LIMIT} s")


def run_case(
    category: str, case_dir: str, entry: Callable[[Sequence[str]], int], argv: Sequence, rss_bound: int
) -> str:
    """Run ``entry(argv)`` as one case of ``category`` in ``case_dir``; tally and return its outcome
    ("succeeded" or "clear error"); any other outcome fails the test with the case's details."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    previous_dir, previous_alarm = os.getcwd(), signal.signal(signal.SIGALRM, _on_alarm)
    _Watch.case_dir, _Watch.violations = os.path.realpath(case_dir), []
    os.chdir(case_dir)
    signal.alarm(TIME_LIMIT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = entry(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code
    except BaseException:  # a traceback: the contract is broken
        rc, err = "traceback", io.StringIO(err.getvalue() + traceback.format_exc())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous_alarm)
        os.chdir(previous_dir)
        _Watch.case_dir = None
    outcome = _outcome(rc, err.getvalue())
    if outcome == "clear error":
        line = next(line for line in err.getvalue().splitlines() if "error:" in line)
        MESSAGES[category][re.sub(r"(/[^\s:,']+)+|-?\d[\d.e+-]*", "#", line.split("error:", 1)[1])[:90]] += 1
    TALLY[category]["generated"] += 1
    TALLY[category][outcome] += 1
    problems = list(_Watch.violations) + (
        [f"peak RSS {_peak_rss() >> 20} MiB > bound {rss_bound >> 20} MiB"] if _peak_rss() > rss_bound else []
    )
    assert outcome != "other" and not problems, (
        f"{category} case {argv}: exit {rc}, {problems}\n{err.getvalue()[-3000:]}"
    )
    return outcome


def _outcome(rc, stderr: str) -> str:
    if rc == 0:
        return "succeeded"
    lines = [line for line in stderr.splitlines() if "error:" in line]
    if rc == 2 and len(lines) == 1 and "Traceback" not in stderr:
        return "clear error"
    return "other"


def fresh_dir(root: str, category: str, template: str = None) -> str:
    """A new, empty (or copied from ``template``) directory for the next case of ``category``."""
    n = sum(TALLY[category].values())
    path = os.path.join(root, f"{category.replace(' ', '_').replace('/', '_')}-{n}")
    shutil.rmtree(path, ignore_errors=True)
    if template:
        shutil.copytree(template, path, symlinks=True)
    else:
        os.makedirs(path)
    return path


def report(rss_bound: int, seconds: float) -> str:
    rows = [f"{'category':<22}" + "".join(f"{c:>13}" for c in CATEGORIES)]
    for category, counts in TALLY.items():
        rows.append(f"{category:<22}" + "".join(f"{counts[c]:>13}" for c in CATEGORIES))
    total = collections.Counter()
    for counts in TALLY.values():
        total.update(counts)
    rows.append(f"{'total':<22}" + "".join(f"{total[c]:>13}" for c in CATEGORIES))
    rows.append("distinct error messages: " + ", ".join(f"{c} {len(m)}" for c, m in MESSAGES.items()))
    rows.append(
        f"wall time {seconds:.1f} s; peak RSS {_peak_rss() >> 20} MiB, bound {rss_bound >> 20} MiB; "
        f"time limit {TIME_LIMIT} s per case"
    )
    return "\n".join(rows)
