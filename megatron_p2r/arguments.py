"""Megatron-style command-line flags and YAML files  <->  ``Config``.

The parser is generated from the dataclass fields of the ``config`` package, plus Megatron-LM's
flags that are not fields (``config/megatron.py``: accepted with no effect, reported once at
start, or refused with an error naming them). Precedence: dataclass defaults < ``--config A.yaml
B.yaml`` (later files win) < flags given on the command line. Unknown YAML keys are errors with a
did-you-mean suggestion. A YAML file is read by a strict safe loader: no aliases (``*name``: an
alias bomb expands a few lines into gigabytes), no key given twice in one mapping (the second
silently won), bounded nesting and size. The config built is checked for the type and range of
every value (``config.check_values``) before it is returned.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
from typing import List, Optional, Sequence, Tuple

import yaml

from megatron_p2r.config import SECTIONS, Config, ConfigError, check_values
from megatron_p2r.config.megatron import (
    MEANING,
    MEGATRON_FLAGS,
    REFUSED,
    UNBUILT_VALUES,
    check_flags,
    implied_values,
    megatron_aliases,
    parsed_flags,
    unbuilt_values,
)
from megatron_p2r.config.fields import field_default
from megatron_p2r.config.layer_pattern import layer_pattern_text, parse_layer_pattern
from megatron_p2r.config.ranges import field_kind
from megatron_p2r.files import MiB, read_bounded


def _layer_pattern(value):
    """``parse_layer_pattern`` with its message shown by argparse (``--moe-layer-freq``)."""
    try:
        return parse_layer_pattern(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_TYPES = {"int": int, "float": float, "str": str, "LayerPattern": _layer_pattern}
YAML_LIMIT = 16 * MiB  # a config file is a few KiB
YAML_DEPTH = 32  # flag values are scalars or lists of them


def _field_type(f: dataclasses.Field) -> str:
    return field_kind(f)[0]


class _StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases, keys given twice and deep nesting."""

    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(
                f"{mark.name}:{mark.line + 1}: YAML aliases (*name) are not allowed in a config file; "
                "write the value out"
            )
        self.depth += 1
        try:
            if self.depth > YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{mark.name}:{mark.line + 1}: nested deeper than {YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"{mark.name}:{mark.line + 1}: key {key!r} is given twice")
            seen.add(key if isinstance(key, (str, int, float, bool)) else id(key_node))
        return super().construct_mapping(node, deep=deep)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_flag(f: dataclasses.Field) -> str:
    """A field's flag: a switch that is on by default is turned off by --no-NAME (Megatron-LM's
    --no-bias-gelu-fusion sets bias_gelu_fusion False)."""
    return _flag(("no_" if f.default is True else "") + f.name)


_ALIASES = megatron_aliases()


def _on_flags(f: dataclasses.Field) -> List[str]:
    """For a switch on by default marked ``on_flag``: --NAME, which turns it back on (Megatron-LM
    versions that had the switch off by default spell it so: --overlap-p2p-communication)."""
    return [_flag(f.name)] if f.default is True and f.metadata.get("on_flag") else []


def field_flags(f: dataclasses.Field) -> List[str]:
    """Every flag that sets a field: ``field_flag``, Megatron-LM's other spellings of it
    (--persistent-save-interval for --save-interval), and the ``on_flag`` spelling."""
    return [field_flag(f), *_ALIASES.get(field_flag(f), ()), *_on_flags(f)]


def all_fields():
    """(section, field) for every configurable option."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def build_parser(description: str = "megatron_p2r pretraining") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--config",
        nargs="+",
        metavar="FILE.yaml",
        help="YAML files whose keys are flag names; later files win, CLI flags win over all.",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            kind = _field_type(f)
            kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=f.metadata.get("help"))
            if kind == "bool":
                kwargs["action"] = "store_false" if f.default is True else "store_true"
            else:
                kwargs["type"] = _TYPES[kind]
                for key in ("choices", "nargs"):
                    if key in f.metadata:
                        kwargs[key] = f.metadata[key]
                if "choices" in kwargs:  # Megatron-LM's other values, refused by name in resolve_values
                    kwargs["choices"] = [*kwargs["choices"], *UNBUILT_VALUES.get(field_flag(f), ())]
            group.add_argument(field_flag(f), *_ALIASES.get(field_flag(f), ()), **kwargs)
            for flag in _on_flags(f):
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=argparse.SUPPRESS,
                    action="store_true",
                    help=f"The default, spelled out: undoes {field_flag(f)} given earlier or in a --config file.",
                )
    fields = {flag for _, f in all_fields() for flag in field_flags(f)}
    group = parser.add_argument_group("Megatron-LM flags that are not config fields (docs/megatron.md)")
    for flag, entry in parsed_flags().items():
        if flag not in fields:
            metavar = None if entry.parse.get("action") or "choices" in entry.parse else flag[2:].upper()
            other = f"; other values: {entry.otherwise[0]}: {entry.otherwise[1]}" if entry.keeps else ""
            help_text = f"{entry.status}: {entry.reason}{other}"
            group.add_argument(
                flag,
                dest=flag,
                default=argparse.SUPPRESS,
                help=help_text,
                **entry.parse,
                **({"metavar": metavar} if metavar else {}),
            )
    return parser


def _normalise_yaml(raw: dict, source: str) -> dict:
    """{field name: value}, and {"--flag": value} for the Megatron-LM flags that are not fields.
    A switch on by default is a key under its field name or its flag (``no-bias-gelu-fusion: true``)."""
    known = {f.name: (_field_type(f), f.metadata) for _, f in all_fields()}
    negated = {field_flag(f)[2:].replace("-", "_"): f.name for _, f in all_fields() if f.default is True}
    known.update({name: ("bool", {}) for name in negated})
    known.update(
        {
            flag.lstrip("-").replace("-", "_"): (_flag_type(entry.parse), entry.parse)
            for flag, entry in parsed_flags().items()
        }
    )
    fields = {f.name for _, f in all_fields()}
    out = {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            hint = difflib.get_close_matches(name, list(known), n=1)
            suggestion = f"; did you mean '{hint[0].replace('_', '-')}'?" if hint else ""
            raise ConfigError(f"{source}: unknown key '{key}'{suggestion}")
        value = _coerce(value, *known[name], source, key)
        if name in negated:
            if value is not None:
                out[negated[name]] = not value
        elif name in fields:
            out[name] = value
        elif value is not None and value is not False:  # a switch set to false is a switch not given
            out[_flag(name)] = value
    return out


def _flag_type(parse: dict) -> str:
    return "bool" if parse.get("action") == "store_true" else parse["type"].__name__


def _coerce(value, kind: str, metadata: dict, source: str, key: str):
    """Check a YAML value against the field's type, so a typo fails here and not mid-run."""
    if value is None:
        return None
    if "nargs" in metadata:
        values = value if isinstance(value, list) else str(value).split()
        return [_coerce(v, kind, {"choices": metadata.get("choices")}, source, key) for v in values]
    try:
        if kind == "bool":
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind == "int" and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise TypeError
        if kind == "str" and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise TypeError  # a set, bytes, a date, a mapping: str() of it would be a path or a name nobody wrote
        converted = _TYPES[kind](value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        quote = "; quote it to give text" if kind == "str" and not isinstance(value, (dict, list, set)) else ""
        raise ConfigError(
            f"{source}: key '{key}' expects {kind}, got {_short(value)} ({_yaml_kind(value)}){quote}"
        ) from None
    choices = metadata.get("choices")
    if choices and converted not in choices and converted not in UNBUILT_VALUES.get(_flag(str(key).lstrip("-")), {}):
        raise ConfigError(f"{source}: key '{key}' must be one of {list(choices)}, got {converted!r}")
    return converted


def _short(value) -> str:
    text = repr(value)  # YAML_DEPTH bounds the nesting
    return text if len(text) <= 80 else text[:77] + "..."


def _yaml_kind(value) -> str:
    """What YAML made of a value, in its words (a timestamp, a set, binary, ...)."""
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "text",
        bytes: "!!binary",
        set: "a !!set",
        dict: "a mapping",
        list: "a list",
        datetime.date: "a date",
        datetime.datetime: "a timestamp",
    }
    return names.get(type(value), type(value).__name__)


def load_yaml(path: str) -> dict:
    try:
        data = read_bounded(path, ConfigError, YAML_LIMIT, "--config")
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        loader = _StrictSafeLoader(data.decode("utf-8"))
        loader.name = path
        try:
            raw = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(raw).__name__}")
    return _normalise_yaml(raw, path)


def config_from_values(values: dict) -> Config:
    """Build a Config from a flat {field_name: value} dict (unknown names are errors), every value
    of its type and in its range."""
    return resolve_values(values)[0]


def resolve_values(values: dict) -> Tuple[Config, List[str]]:
    """(the Config, every value of its type and in its range; the "FLAG (reason)" of each given
    Megatron-LM flag that has no effect here, config fields the flag table qualifies by value
    included); a refused flag raises ConfigError."""
    values = _normalise_yaml(values, "config")
    megatron = {name: values.pop(name) for name in list(values) if name.startswith("--")}
    unbuilt = unbuilt_values({_flag(name): value for name, value in values.items()})
    values = {name: value for name, value in values.items() if _flag(name) not in unbuilt}  # named below
    cfg = Config().replace(**implied_values(values))
    check_values(cfg)
    qualified_fields = {
        _flag(name): value
        for name, value in values.items()
        if _flag(name) in MEGATRON_FLAGS and value is not None and value is not False
    }
    return cfg, check_flags({**megatron, **qualified_fields}, cfg, tuple(unbuilt.values()))


def parse_launch(
    argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
) -> Tuple[Config, List[str]]:
    """The command line of ``pretrain_m6.py``: (Config, flags with no effect here)."""
    parser = parser or build_parser()
    given = vars(parser.parse_args(argv))
    values = {}
    for path in given.pop("config", None) or []:
        values.update(load_yaml(path))
    values.update(given)
    return resolve_values(values)


def parse_args(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None) -> Config:
    return parse_launch(argv, parser)[0]


def flag_statuses(argv: Sequence[str]) -> List[Tuple[str, str, str, str]]:
    """(flag, value as written, status, why) of every flag of a Megatron-LM command line, the
    last occurrence winning as in argparse: config fields have Megatron-LM's meaning, the others
    what ``config/megatron.py`` says; a flag neither knows is "unknown"."""
    given = {}
    for token in argv:
        if token.startswith("--"):
            values_of_flag = given.setdefault(token, [])
            values_of_flag.clear()
        elif given:
            values_of_flag.append(token)
    fields = {flag: f for _, f in all_fields() for flag in field_flags(f)}
    built = {
        name: values
        for name, values in given.items()
        if name in fields and " ".join(values) not in UNBUILT_VALUES.get(name, {})
    }
    cfg = parse_args([token for name, values in built.items() for token in (name, *values)])
    out = []
    for name, values in given.items():
        entry = MEGATRON_FLAGS.get(name)
        if entry is not None:
            status, why = entry.resolve(_typed(values, entry.parse), cfg)
        elif name in fields and " ".join(values) in UNBUILT_VALUES.get(name, {}):
            status, why = REFUSED, UNBUILT_VALUES[name][" ".join(values)]
        elif name in fields:
            status, why = MEANING, "config field"
        else:
            status, why = "unknown", ""
        out.append((name, " ".join(values), status, why))
    return out


def _typed(values: List[str], parse: dict):
    if not parse or parse.get("action") == "store_true":
        return True if not values else values
    typed = [parse["type"](v) for v in values]
    return typed if "nargs" in parse else typed[0]


def to_argv(cfg: Config) -> list:
    """The flags that reproduce ``cfg`` (used by tools that launch training)."""
    argv = []
    for section, f in all_fields():
        value = getattr(getattr(cfg, section), f.name)
        if value == field_default(f) or value is None:
            continue
        if isinstance(value, bool):
            argv.append(field_flag(f))
        elif isinstance(value, list) and _field_type(f) == "LayerPattern":
            argv += [_flag(f.name), layer_pattern_text(value)]
        elif isinstance(value, list):
            argv += [_flag(f.name), *map(str, value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv


__all__ = [
    "build_parser",
    "parse_args",
    "parse_launch",
    "load_yaml",
    "config_from_values",
    "resolve_values",
    "flag_statuses",
    "field_flag",
    "field_flags",
    "to_argv",
]
