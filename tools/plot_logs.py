"""Plot training logs (``--log-file`` JSONL) against iterations, tokens and FLOPs.

    python tools/plot_logs.py --log-file pseudo.jsonl real.jsonl --output loss.png

Logs given in order are drawn as one run (a Pseudo-to-Real run is its pseudo log followed by
its real log); a vertical line marks where the phase changes (the delink point). Several
``--run NAME=LOG[,LOG...]`` compare runs. Needs matplotlib (``pip install .[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

from megatron_p2r.cli import run_tool
from megatron_p2r.config import ConfigError


def read_records(paths: List[str]) -> List[dict]:
    """The JSON objects of the logs, in order; each has a numeric iteration (what the plots need)."""
    records = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        records.append(_record(path, number, line))
        except FileNotFoundError:
            raise ConfigError(f"--log-file {path}: no such file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--log-file {path}: not UTF-8 text (a training log is JSONL)") from None
    return records


def _record(path: str, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path}:{number}: not a JSON line ({getattr(exc, 'msg', 'nested too deeply')})") from None
    if not isinstance(record, dict) or not isinstance(record.get("iteration"), (int, float)):
        raise ConfigError(f"{path}:{number}: expected a JSON object with a numeric 'iteration' (a --log-file record)")
    return record


def series(records: List[dict], key: str) -> Dict[str, list]:
    """x values (iteration, tokens, flops), the ``key`` values, and the phase-change x positions."""
    rows = [r for r in records if key in r]
    out = {
        "iteration": [r["iteration"] for r in rows],
        "tokens": [r.get("tokens") for r in rows],
        "flops": [r.get("flops") for r in rows],
        key: [r[key] for r in rows],
        "delink": [],
    }
    for prev, cur in zip(rows, rows[1:], strict=False):
        if prev.get("phase") != cur.get("phase"):
            out["delink"].append(prev)  # the last record of the old phase: where it was delinked
    return out


def plot(runs: Dict[str, List[dict]], output: str, key: str = "lm_loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_x = ["iteration", "tokens", "flops"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, records in runs.items():
        s = series(records, key)
        for ax, x in zip(axes, axes_x, strict=True):
            xs = s[x]
            if not xs or any(v is None for v in xs):
                continue
            ax.plot(xs, s[key], label=name)
            for row in s["delink"]:
                ax.axvline(row[x], color="gray", linestyle="--")
    for ax, x in zip(axes, axes_x, strict=True):
        ax.set_xlabel({"iteration": "iteration", "tokens": "tokens", "flops": "model FLOPs"}[x])
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("dashed line: delink (pseudo -> real)")
    fig.tight_layout()
    fig.savefig(output, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-file", nargs="+", help="JSONL logs drawn as one run, in order")
    parser.add_argument(
        "--run", action="append", default=[], metavar="NAME=LOG[,LOG]", help="a named run (repeatable) to compare runs"
    )
    parser.add_argument("--key", default="lm_loss", help="value to plot (lm_loss or eval_loss)")
    parser.add_argument("--output", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    return run_tool(lambda: _plot_runs(parser, args))


def _plot_runs(parser: argparse.ArgumentParser, args) -> int:
    runs = {}
    if args.log_file:
        runs["run"] = read_records(args.log_file)
    for spec in args.run:
        name, sep, paths = spec.partition("=")
        if not sep:
            parser.error(f"--run {spec!r}: expected NAME=LOG[,LOG...]")
        runs[name] = read_records(paths.split(","))
    if not runs:
        parser.error("give --log-file or --run")
    if not any(key_rows for key_rows in (series(r, args.key)[args.key] for r in runs.values())):
        raise ConfigError(f"no record has the key {args.key!r}")
    plot(runs, args.output, args.key)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
