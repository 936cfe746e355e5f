"""What every section module shares: the field helper that makes a flag, and the error type
(the range of each value: ``ranges.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import field


def opt(default, help: str, **kwargs):
    """A dataclass field that is also a CLI flag (``choices``, ``nargs`` go to argparse; ``on_flag``:
    a switch on by default also takes --NAME, see ``arguments.field_flags``). A list default
    (Megatron-LM's ``--profile-ranks 0``) is copied into each config."""
    metadata = {"help": help, **kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def field_default(f: dataclasses.Field):
    """The default of a field made by ``opt``, a list default included."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag(s) and what was expected."""
