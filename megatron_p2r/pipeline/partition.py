"""Which layers each pipeline stage holds. Pure functions, testable without processes."""
from __future__ import annotations

from typing import List, Optional

from megatron_p2r.config import ConfigError


def stage_layer_counts(num_layers: int, pp: int, split: Optional[str] = None) -> List[int]:
    """Layers per stage: even (earlier stages take the remainder) or an explicit '3,5,5,3'."""
    if split:
        try:
            counts = [int(x) for x in split.split(",")]
        except ValueError:
            raise ConfigError(f"--pipeline-layer-split {split!r}: expected comma-separated integers") from None
        if len(counts) != pp:
            raise ConfigError(f"--pipeline-layer-split {split!r} has {len(counts)} entries but "
                              f"--pipeline-model-parallel-size is {pp}")
        if any(c < 1 for c in counts):
            raise ConfigError(f"--pipeline-layer-split {split!r}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ConfigError(f"--pipeline-layer-split {split!r} adds up to {sum(counts)}, "
                              f"but --num-layers is {num_layers}")
        return counts
    if pp > num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size ({pp}) exceeds --num-layers ({num_layers}): "
                          "a stage would be empty")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def stage_layer_ranges(num_layers: int, pp: int, split: Optional[str] = None) -> List[range]:
    """Global layer indices of each stage."""
    ranges, start = [], 0
    for count in stage_layer_counts(num_layers, pp, split):
        ranges.append(range(start, start + count))
        start += count
    return ranges
