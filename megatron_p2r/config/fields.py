"""What every section module shares: the field helper that makes a flag, and the error type
(the range of each value: ``ranges.py``)."""

from __future__ import annotations

from dataclasses import field


def opt(default, help: str, **kwargs):
    """A dataclass field that is also a CLI flag (``choices``, ``nargs`` go to argparse; ``on_flag``:
    a switch on by default also takes --NAME, see ``arguments.field_flags``)."""
    return field(default=default, metadata={"help": help, **kwargs})


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag(s) and what was expected."""
