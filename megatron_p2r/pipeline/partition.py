"""Which layers each pipeline stage holds. Pure functions, testable without processes."""
from __future__ import annotations

from typing import List, Optional

from megatron_p2r.config import stage_layer_counts


def stage_layer_ranges(num_layers: int, pp: int, split: Optional[str] = None) -> List[range]:
    """Global layer indices of each stage."""
    ranges, start = [], 0
    for count in stage_layer_counts(num_layers, pp, split):
        ranges.append(range(start, start + count))
        start += count
    return ranges
