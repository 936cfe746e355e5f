"""Depth growth: a model of L/k layers (real or pseudo) becomes one of L layers, as pure
functions on layer maps; the converter (``convert/reshard.py``) streams the tensors.

Two orders, as in the literature:

- ``stack`` (Gong et al. 2019; Du et al. 2024, "G_stack"): the whole trained model is placed k
  times on top of itself, target layer j <- source layer j mod (L/k). For L/k = 3, k = 2:
  0 1 2 0 1 2.
- ``interleave``: each source layer is repeated k times in place, target layer j <- source
  layer j div k: 0 0 1 1 2 2.

Unlike delinking, growth is **not function-preserving**: the grown model applies each layer k
times, so its loss right after growth differs from the source's. Its value is that the early
phase trains a model k times shallower, which costs fewer FLOPs per token.
"""

from __future__ import annotations

from typing import List, Sequence

from megatron_p2r.config import ConfigError

GROW_METHODS = ("stack", "interleave")


def grown_layers(num_source_layers: int, num_layers: int, method: str) -> List[int]:
    """The source layer of each of the ``num_layers`` target layers."""
    small = num_source_layers
    if method not in GROW_METHODS:
        raise ConfigError(f"--method must be one of {GROW_METHODS}, got {method!r}")
    if num_layers <= small or num_layers % small:
        raise ConfigError(f"--num-layers {num_layers} must be a multiple k >= 2 of the source's {small} layers")
    k = num_layers // small
    return [j % small if method == "stack" else j // k for j in range(num_layers)]


def check_layer_kinds(
    source_layers: Sequence[int], source_moe: Sequence[bool], target_moe: Sequence[bool], method: str
) -> None:
    """A target layer must be of its source layer's kind (dense or MoE): with MoE in every
    other layer, ``interleave`` would put a dense layer's weights into an MoE layer."""
    kinds = ("dense", "MoE")
    for j, (src, moe) in enumerate(zip(source_layers, target_moe, strict=True)):
        if source_moe[src] != moe:
            raise ConfigError(
                f"grow --method {method}: target layer {j} is {kinds[moe]} but its source layer "
                f"{src} is {kinds[source_moe[src]]}; choose a method or --num-layers that keeps "
                "every layer's kind (--moe-layer-freq)"
            )
