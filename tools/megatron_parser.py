"""Write megatron_p2r/config/megatron_parser.json: every flag of Megatron-LM's own argument parser.

The table is made by Megatron-LM's code, never typed: ``add_megatron_arguments`` (the parser of
``pretrain_gpt.py``) is run and each of its actions written down as argparse holds it (flags,
dest, action, type, nargs, choices, default). Needs megatron-core 0.16.1 and Megatron-LM's
``megatron/training`` of tag core_v0.16.1 on the path (the wheel lacks it), as
tests/fixtures/megatron/make_fixtures.py describes; with the CPU torch of this project's venv:

    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1
    pip install --no-deps --target /tmp/mdeps six triton
    git -C Megatron-LM archive core_v0.16.1 megatron/training megatron/legacy megatron/rl \\
        megatron/post_training | tar -x -C /tmp/mtrain
    mkdir -p /tmp/mrun/megatron && ln -s /tmp/mcore/megatron/core /tmp/mrun/megatron/core
    for d in training legacy rl post_training; do ln -s /tmp/mtrain/megatron/$d /tmp/mrun/megatron/$d; done
    PYTHONPATH=/tmp/mrun:/tmp/mdeps python tools/megatron_parser.py --revision core_v0.16.1

``megatron_p2r/config/megatron.py`` reads the table: a flag of it that is neither a config field
nor in its hand-written entries takes the status of its family there (tests/config/test_megatron_parser.py).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "megatron_p2r", "config", "megatron_parser.json")
_ACTIONS = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "BooleanOptionalAction": "boolean_optional",
}


def _plain(value):
    """A default or choice as JSON holds it: enums by name, anything else unusual by repr."""
    if isinstance(value, enum.Enum):  # an IntEnum too (signals): the name a user types
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "name", repr(value))


def _type_name(kind) -> str | None:
    if kind is None:
        return None
    return kind.__name__ if kind in (int, float, str, bool) else "str"  # Megatron's own parsers read text


def megatron_actions() -> list:
    """One record per argparse action of Megatron-LM's parser (help excluded)."""
    from megatron.training.arguments import add_megatron_arguments  # needs Megatron-LM (see the docstring)

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    records = []
    for action in parser._actions:
        kind = type(action).__name__
        if kind == "_HelpAction":
            continue
        if kind not in _ACTIONS:
            raise SystemExit(f"error: {action.option_strings}: action {kind} is not one this table knows")
        records.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "action": _ACTIONS[kind],
                "type": _type_name(action.type),
                "nargs": action.nargs,
                "choices": _plain(list(action.choices)) if action.choices else None,
                "default": _plain(action.default),
            }
        )
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="the Megatron-LM tag or commit on the path")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    records = megatron_actions()
    table = {
        "revision": args.revision,
        "made_by": "tools/megatron_parser.py (add_megatron_arguments)",
        "flags": sum(len(r["flags"]) for r in records),
        "actions": records,
    }
    tmp = args.output + ".tmp"
    head = json.dumps({key: value for key, value in table.items() if key != "actions"})[:-1]
    with open(tmp, "w", encoding="utf-8") as fh:  # one action a line: a regenerated table diffs by flag
        fh.write(head + ', "actions": [\n' + ",\n".join(json.dumps(r) for r in records) + "\n]}\n")
    os.replace(tmp, args.output)
    print(f"{table['flags']} flags of {len(records)} actions -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
