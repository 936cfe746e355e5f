"""Megatron-LM launch scripts against this framework's flags (docs/megatron.md).

    python tools/megatron_flags.py extract SCRIPT --arg NAME=VALUE ... [--env K=V] [--dir DIR] --output FIXTURE.json
    python tools/megatron_flags.py count FIXTURE.json ...     # accepted with meaning / no effect / refused
    python tools/megatron_flags.py table FIXTURE.json ...     # the flag table of docs/megatron.md
    python tools/megatron_flags.py parser                     # Megatron-LM's whole parser by status here

``extract`` runs the script with bash as it is, except that ``torchrun`` (and ``python -m
torch.distributed.run``) is a stand-in that writes the arguments after the training script:
exactly the argv Megatron-LM's ``pretrain_gpt.py`` would get, with bash's own expansion (quotes
left inside an array element stay in the argument); ``uv run`` and ``nsys profile ...`` before
the launcher run what follows them. The script's parameters are given as
``--arg NAME=VALUE`` in order (only VALUE is passed; NAME documents it); ``--dir`` makes a
directory the script insists exists; the temporary directory the script runs in is written as
``{WORKDIR}``. The fixtures in
``tests/fixtures/megatron_scripts/`` were made this way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_p2r.arguments import all_fields, build_parser, field_flags, flag_statuses  # noqa: E402
from megatron_p2r.config.megatron import MEGATRON_FLAGS, STATUSES, megatron_parser  # noqa: E402

# torchrun's stand-in: print the arguments that follow the training script, one JSON list.
_TORCHRUN = """#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
script = next(i for i, a in enumerate(args) if a.endswith(".py"))
print(json.dumps(args[script + 1:]))
"""
# python's stand-in: ``python -m torch.distributed.run ...`` is torchrun; anything else runs python.
_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then shift 2; exec torchrun "$@"; fi
exec {python} "$@"
"""

# Wrappers a script may put before the launcher (``uv run``, ``nsys profile ...``): run what follows.
_UV = """#!/bin/sh
[ "$1" = "run" ] && shift
exec "$@"
"""
_NSYS = """#!/bin/sh
while [ $# -gt 0 ] && [ "$1" != "python" ] && [ "$1" != "torchrun" ]; do shift; done
exec "$@"
"""


def _stand_in(bin_dir: str, name: str, text: str) -> None:
    with open(os.path.join(bin_dir, name), "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(os.path.join(bin_dir, name), 0o755)


def extract(script: str, args: List[str], env: Dict[str, str], dirs: Sequence[str] = ()) -> List[str]:
    """The argv the script hands to its training script."""
    with tempfile.TemporaryDirectory() as work:
        bin_dir = os.path.join(work, "bin")
        os.mkdir(bin_dir)
        _stand_in(bin_dir, "torchrun", _TORCHRUN)
        _stand_in(bin_dir, "python", _PYTHON.format(python=sys.executable))
        _stand_in(bin_dir, "uv", _UV)
        _stand_in(bin_dir, "nsys", _NSYS)
        for name in dirs:
            os.makedirs(os.path.join(work, name), exist_ok=True)
        open(os.path.join(work, "pretrain_gpt.py"), "w").close()  # scripts that check it is there
        run_env = {"PATH": bin_dir + os.pathsep + os.environ["PATH"], "HOME": work, **env}
        out = subprocess.run(
            ["bash", os.path.abspath(script), *args], cwd=work, env=run_env, capture_output=True, text=True, check=True
        ).stdout
        argv = json.loads(out.strip().splitlines()[-1])
        return [a.replace(os.path.realpath(work), "{WORKDIR}").replace(work, "{WORKDIR}") for a in argv]


def load_fixture(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def counts(argv: List[str]) -> Dict[str, int]:
    """Flags of one command line by status (each flag once)."""
    found = Counter(status for _, _, status, _ in flag_statuses(argv))
    return {status: found.get(status, 0) for status in (*STATUSES, "unknown")}


def table(fixtures: List[dict]) -> str:
    """One row per flag of the scripts: the values they give, which scripts use it, its status."""
    rows: Dict[str, dict] = {}
    for fixture in fixtures:
        for flag, value, status, why in flag_statuses(fixture["argv"]):
            row = rows.setdefault(flag, {"values": [], "scripts": [], "status": status, "why": why})
            if value and value not in row["values"]:
                row["values"].append(value)
            row["scripts"].append(fixture["name"])
            if status != row["status"]:
                row["status"], row["why"] = f"{row['status']} / {status}", f"{row['why']} / {why}"
    names = [f["name"] for f in fixtures]
    lines = [
        "| flag | value in the scripts | " + " | ".join(names) + " | status here | why |",
        "|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for flag in sorted(rows):
        row = rows[flag]
        used = " | ".join("x" if name in row["scripts"] else "" for name in names)
        values = ", ".join(f"`{v}`" for v in row["values"])
        lines.append(f"| `{flag}` | {values} | {used} | {row['status']} | {row['why']} |")
    return "\n".join(lines) + "\n"


def count_table(fixtures: List[dict]) -> str:
    lines = ["| script | flags | " + " | ".join(STATUSES) + " | unknown |", "|---|---|" + "---|" * (len(STATUSES) + 1)]
    for fixture in fixtures:
        found = counts(fixture["argv"])
        lines.append(
            f"| {fixture['name']} | {sum(found.values())} | " + " | ".join(str(found[s]) for s in found) + " |"
        )
    return "\n".join(lines) + "\n"


def parser_counts() -> str:
    """Megatron-LM's parser (megatron_parser.json): its flags as config fields, by the status of
    their entry here (at a value other than Megatron's default), and unknown."""
    table = megatron_parser()
    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    fields = {flag for _, f in all_fields() for flag in field_flags(f)}
    found = Counter()
    for flag in (flag for action in table["actions"] for flag in action["flags"]):
        found[
            "unknown" if flag not in known else "config field" if flag in fields else MEGATRON_FLAGS[flag].status
        ] += 1
    names = ["config field", *STATUSES, "unknown"]
    return (
        f"Megatron-LM {table['revision']}: {table['flags']} flags (and --help)\n"
        "| " + " | ".join(names) + " |\n|" + "---|" * len(names) + "\n"
        "| " + " | ".join(str(found[name]) for name in names) + " |\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help="the argv a launch script passes to pretrain_gpt.py, as a fixture")
    ex.add_argument("script")
    ex.add_argument("--name", required=True, help="the column name of the script in the table")
    ex.add_argument("--source", default="", help="where the script comes from (repository, commit, path)")
    ex.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="positional parameters")
    ex.add_argument("--env", action="append", default=[], metavar="K=V")
    ex.add_argument(
        "--dir",
        action="append",
        default=[],
        help="a directory the script checks exists (relative to the directory it runs in)",
    )
    ex.add_argument("--output", required=True)
    for name in ("count", "table"):
        sub.add_parser(name).add_argument("fixtures", nargs="+")
    sub.add_parser("parser", help="Megatron-LM's whole parser by status here")
    args = parser.parse_args(argv)
    if args.command == "parser":
        print(parser_counts(), end="")
        return 0
    if args.command == "extract":
        positional = [a.partition("=")[2] for a in args.arg]
        env = dict(e.partition("=")[::2] for e in args.env)
        fixture = {
            "name": args.name,
            "source": args.source,
            "args": args.arg,
            "env": env,
            "argv": extract(args.script, positional, env, args.dir),
        }
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(fixture, fh, indent=1)
            fh.write("\n")
        return 0
    fixtures = [load_fixture(path) for path in args.fixtures]
    print(count_table(fixtures) if args.command == "count" else table(fixtures), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
