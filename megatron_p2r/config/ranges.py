"""Type and range of every config value, checked before anything is built.

Each section module keeps one table, ``RANGES`` beside its dataclass, of the numeric fields'
ranges; the type comes from the field's annotation. ``check_values`` runs both for a whole
config: a value from the command line, a YAML file or a checkpoint's metadata.json that is NaN,
of the wrong type, negative where a count is meant, or absurdly large (``--num-layers 1000000``)
fails here with one message naming the flag, instead of tens of seconds of allocation or a
traceback from deep inside. Upper bounds are far above any real run (a 10T-parameter model has
tens of layers, not thousands); the memory such a run would need is checked separately, against
the machine (``planning/preflight.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional

from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.layer_pattern import parse_layer_pattern

COUNT = 2**40  # iterations, samples: any run, with room
LAYERS = 2**12  # layers, heads: 85x the 48 layers of M6-10T (the planner's estimate is linear in them)


def _number(x: float) -> str:
    """16384, 0.5, inf (not 1.6384e+04)."""
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``low_open``: ``low < value``; None: unbounded); floats must be finite."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        """'[1, 16384]', '(0, inf)', '[0, 1)'."""
        lo = "-inf" if self.low is None else _number(self.low)
        hi = "inf" if self.high is None else _number(self.high)
        closed_high = not self.high_open and self.high is not None and math.isfinite(self.high)
        return f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}{']' if closed_high else ')'}"

    def violated(self, value) -> str:
        """The bound ``value`` breaks, as the message says it: '>= 1', '< 1'."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"{'<' if self.high_open else '<='} {_number(self.high)}"

    def contains(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def at_least(low: float, high: float = COUNT) -> Range:
    return Range(low, high)


def positive(high: float = math.inf) -> Range:
    return Range(0.0, high, low_open=True)


def fraction() -> Range:
    """[0, 1): dropout probabilities, Adam betas."""
    return Range(0.0, 1.0, high_open=True)


def field_kind(f: dataclasses.Field) -> tuple:
    """(base type name, optional, list) from the annotation, e.g. 'Optional[List[str]]'."""
    hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = hint.startswith("Optional[")
    hint = hint.replace("Optional[", "").replace("]", "")
    is_list = hint.startswith("List[")
    return hint.replace("List[", ""), optional, is_list


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _type_error(name: str, kind: str, value) -> ConfigError:
    shown = repr(value) if not isinstance(value, str) else repr(value[:60])
    return ConfigError(f"{flag_name(name)} expects {kind}, got {shown} ({type(value).__name__})")


def _check_scalar(name: str, kind: str, value) -> None:
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise ConfigError(f"{flag_name(name)} must be a finite number, got {value}")
    elif kind == "LayerPattern":
        try:
            ok = parse_layer_pattern(value) == value
        except ValueError as err:
            raise ConfigError(f"{flag_name(name)}: {err}") from None
        if not ok:
            raise _type_error(name, "an integer >= 1 or a list of 0 and 1", value)
    else:  # str: also no NUL, which no path or name can hold
        ok = isinstance(value, str)
        if ok and "\x00" in value:
            raise ConfigError(f"{flag_name(name)} must not contain a NUL character")
    if not ok:
        raise _type_error(name, kind, value)


def check_fields(section, ranges: Dict[str, Range]) -> None:
    """Every field of the dataclass ``section`` has its annotated type and lies in its range."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        kind, optional, is_list = field_kind(f)
        if value is None:
            if not optional:
                raise _type_error(f.name, kind, value)
            continue
        if is_list and not isinstance(value, list):
            raise _type_error(f.name, f"a list of {kind}", value)
        count = f.metadata.get("nargs")
        if is_list and isinstance(count, int) and len(value) != count:
            raise ConfigError(f"{flag_name(f.name)} expects {count} values, got {len(value)}")
        for item in value if is_list else [value]:
            _check_item(f, kind, item, ranges.get(f.name))


def _check_item(f: dataclasses.Field, kind: str, value, limits: Optional[Range]) -> None:
    """A scalar value, or one item of a list value (each item in the field's range)."""
    _check_scalar(f.name, kind, value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{flag_name(f.name)} must be one of {choices}, got {value!r}")
    if limits is not None and not limits.contains(value):
        raise ConfigError(
            f"{flag_name(f.name)} must be {limits.violated(value)}, got {value} (range {limits.describe()})"
        )


def numeric_fields_without_range(section_cls, ranges: Dict[str, Range]) -> list:
    """The int/float fields a section's table forgets (a test keeps this empty)."""
    return [
        f.name for f in dataclasses.fields(section_cls) if field_kind(f)[0] in ("int", "float") and f.name not in ranges
    ]
