"""What every section module shares: the field helper that makes a flag, the error type, and
the range checks whose messages must read the same for every flag."""
from __future__ import annotations

from dataclasses import field
from typing import Optional, Tuple

Flag = Tuple[str, Optional[float]]


def opt(default, help: str, **kwargs):
    """A dataclass field that is also a CLI flag (``choices``, ``nargs`` go to argparse)."""
    return field(default=default, metadata={"help": help, **kwargs})


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag(s) and what was expected."""


def require_at_least_one(*flags: Flag, unset_disables: bool = False) -> None:
    """Each (flag, value) is unset or >= 1; ``unset_disables`` says how to turn the feature off."""
    hint = " (leave it unset to disable)" if unset_disables else ""
    for name, value in flags:
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}{hint}")


def require_positive(*flags: Flag) -> None:
    """Each (flag, value) is unset or > 0."""
    for name, value in flags:
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
