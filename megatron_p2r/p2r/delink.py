"""Delinking (pseudo -> real) as pure functions on names and tensors.

In the pseudo phase layer i calls module ``key(i)`` (``sharing.layer_module_keys``), so its
parameters are named ``layers.{key(i)}.*``. The real model names them ``layers.{i}.*``.
Delinking gives real layer i a copy of ``key(i)``'s tensors; since every real layer then
computes what the pseudo layer computed, the real model is the same function.

Optimizer moments, by ``--optimizer-state``:
- ``copy``: each layer inherits its slot's moments as they are;
- ``rescale``: a shared slot's gradient is the *sum* of its N layers' gradients, so one
  layer's share is about 1/N of it: first moment / N, second moment / N^2;
- ``reset``: no moments (AdamW starts fresh; iteration and LR schedule carry over).

``--noise-std`` adds N(0, std^2) noise to every delinked layer weight (to break the symmetry
between copies of one slot), drawn per *global* tensor from a generator seeded by
(seed, name), so it does not depend on the target layout.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Optional, Sequence

import torch

from megatron_p2r.parallel.sharding import draw

OPTIMIZER_STATE_MODES = ("copy", "rescale", "reset")


def layer_of(key: str) -> Optional[int]:
    """i for a name under ``layers.i.``, else None."""
    parts = key.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None


def source_key(real_key: str, layer_keys: Sequence[int]) -> str:
    """The pseudo piece that real piece ``real_key`` is copied from: ``layers.i.X <- layers.{key(i)}.X``."""
    layer = layer_of(real_key)
    if layer is None:
        return real_key
    return f"layers.{layer_keys[layer]}.{real_key.split('.', 2)[2]}"


def slot_sizes(layer_keys: Sequence[int]) -> Dict[int, int]:
    """module key -> N, the number of layers that call it."""
    return dict(Counter(layer_keys))


def delink_moment(kind: str, tensor: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """One optimizer tensor of a layer copied from a slot shared by ``n`` layers."""
    if mode not in OPTIMIZER_STATE_MODES or mode == "reset":
        raise ValueError(f"delink_moment: mode must be copy or rescale, got {mode!r}")
    if mode == "copy" or kind == "step" or n == 1:
        return tensor
    if kind == "exp_avg":
        return tensor / n
    if kind == "exp_avg_sq":
        return tensor / (n * n)
    raise ValueError(f"unknown optimizer state {kind!r}")


def add_noise(tensor: torch.Tensor, real_key: str, std: float, seed: int) -> torch.Tensor:
    """``tensor`` (a whole global piece) plus N(0, std^2) noise seeded by (seed, real_key)."""
    if std <= 0:
        return tensor
    return tensor + draw(f"delink-noise:{real_key}", tuple(tensor.shape), ("normal", std), seed).to(tensor.dtype)
