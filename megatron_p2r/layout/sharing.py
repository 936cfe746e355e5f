"""Share patterns: which parameter *slot* each transformer layer uses.

Pure functions of (pattern, number of layers), so the model builder, the gradient-sharing
groups, the checkpoint metadata and the delinking tool all agree without processes.

    none      slot = i                (the real model)
    all       slot = 0
    cycle:K   slot = i mod K          (K slots used round-robin)
    block:K   slot = i // (L / K)     (K contiguous blocks of L/K layers)
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from megatron_p2r.config import parse_share_pattern


def layer_to_slot(pattern: str, num_layers: int) -> List[int]:
    """slot index of every layer 0..L-1."""
    kind, k = parse_share_pattern(pattern, num_layers)
    if kind == "none":
        return list(range(num_layers))
    if kind == "all":
        return [0] * num_layers
    if kind == "cycle":
        return [i % k for i in range(num_layers)]
    return [i // (num_layers // k) for i in range(num_layers)]


def effective_pattern(phase: str, pattern: str) -> str:
    """The real phase never shares, whatever --share-pattern says."""
    return pattern if phase == "pseudo" else "none"


def slot_to_layers(slots: Sequence[int]) -> Dict[int, List[int]]:
    """Inverse map: slot (or module key) -> the layers that use it (in order); the one such map."""
    out: Dict[int, List[int]] = {}
    for layer, slot in enumerate(slots):
        out.setdefault(slot, []).append(layer)
    return out


def stages_using_slot(slots: Sequence[int], stage_ranges: Sequence[Sequence[int]]) -> Dict[int, List[int]]:
    """slot -> the pipeline stages holding a replica of it (each stage builds one module per slot,
    whichever of its layers use it)."""
    out: Dict[int, List[int]] = {}
    for stage, layers in enumerate(stage_ranges):
        for slot in sorted({slots[i] for i in layers}):
            out.setdefault(slot, []).append(stage)
    return out


def layer_module_keys(pattern: str, num_layers: int, is_moe: Sequence[bool]) -> List[int]:
    """The module each layer calls, named by the first layer that uses it.

    Layers share a module when they have the same slot *and* the same kind (dense or MoE),
    so ``all`` with MoE in every other layer gives one dense and one MoE module. In the real
    phase (pattern ``none``) every layer is its own key.
    """
    slots = layer_to_slot(pattern, num_layers)
    owner: Dict[tuple, int] = {}
    return [owner.setdefault((slots[i], bool(is_moe[i])), i) for i in range(num_layers)]
