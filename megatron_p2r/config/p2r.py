"""The Pseudo-to-Real section: the phase and the share pattern's syntax.

Which slot each layer uses is ``layout/sharing.py``; the pattern is parsed here so a bad one
fails at validation, before any model code runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from megatron_p2r.config.fields import ConfigError, opt


@dataclass(frozen=True)
class P2RConfig:
    p2r_phase: str = opt("real", "Pseudo-to-Real phase.", choices=["pseudo", "real"])
    share_pattern: str = opt("all", "Pseudo phase: layer->slot map: all | cycle:K | block:K | none.")

    def check(self, num_layers: int) -> None:
        parse_share_pattern(self.share_pattern, num_layers)


def parse_share_pattern(pattern: str, num_layers: int) -> Tuple[str, int]:
    """Validate ``pattern`` for ``num_layers`` layers; return (kind, K)."""
    kind, _, arg = pattern.partition(":")
    if kind in ("none", "all") and not arg:
        return kind, num_layers if kind == "none" else 1
    if kind in ("cycle", "block"):
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"--share-pattern {pattern!r}: '{kind}' needs an integer K, as in '{kind}:2'") from None
        if not 1 <= k <= num_layers:
            raise ConfigError(f"--share-pattern {pattern!r}: K must be between 1 and --num-layers ({num_layers})")
        if kind == "block" and num_layers % k:
            raise ConfigError(f"--share-pattern {pattern!r}: K ({k}) must divide --num-layers ({num_layers})")
        return kind, k
    raise ConfigError(f"--share-pattern {pattern!r}: expected all, none, cycle:K or block:K")


# No numeric fields: the type checks of config/ranges.py cover the section.
RANGES: dict = {}
