"""Delinking (pseudo -> real, or pseudo -> a finer pseudo pattern) as pure functions on names
and tensors.

In the pseudo phase layer i calls module ``key(i)`` (``sharing.layer_module_keys``), so its
parameters are named ``layers.{key(i)}.*``; a module is named by the first layer that calls
it, and the real model names layer i's parameters ``layers.{i}.*``. A conversion gives every
target module a copy of the source module its layers called: ``layer_sources[i]`` is the
source module of target layer i (the source's own map when delinking; ``grow.py`` builds it
for depth growth). Delinking to a *finer* pattern (``all -> cycle:K -> none``, each a chain
link) preserves the function as long as every target module's layers called one source
module (``check_refinement``).

Optimizer moments, by ``--optimizer-state``:
- ``copy``: each target module inherits its source module's moments as they are;
- ``rescale``: a module's gradient is the *sum* over the layers that call it, so a target
  module called by M of the source module's N layers gets about M/N of it: first moment
  times M/N (AdamW's and Lion's ``exp_avg``), second moment times (M/N)^2 (M = 1 for the real
  model: /N and /N^2). Adafactor's row and column statistics are each a mean of g^2, so each is
  scaled by (M/N)^2, and so is the second moment R x C / mean(R) they estimate;
- ``reset``: no moments (the optimizer starts fresh; iteration and LR schedule carry over).

``--noise-std`` adds N(0, std^2) noise to every copied layer weight (to break the symmetry
between copies of one module), drawn per *global* tensor from a generator seeded by
(seed, name), so it does not depend on the target layout. With ``--noise-relative`` the std
is that fraction of each tensor's own std (a norm weight of ones gets none). The std is at
most ``MAX_NOISE_STD``: 1 is already 50 times the scale of initialised weights (std 0.02), or
noise as large as the tensor itself; more only destroys the model (and overflows in float32
well before float64 notices).
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, Optional, Sequence

import torch

from megatron_p2r.config import ConfigError
from megatron_p2r.config.optimizers import GRADIENT_POWER
from megatron_p2r.parallel.sharding import draw

OPTIMIZER_STATE_MODES = ("copy", "rescale", "reset")
MAX_NOISE_STD = 1.0


def layer_of(key: str) -> Optional[int]:
    """i for a name under ``layers.i.``, else None."""
    parts = key.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None


def source_key(target_key: str, layer_sources: Sequence[int]) -> str:
    """The source piece that target piece ``target_key`` is copied from:
    ``layers.t.X <- layers.{layer_sources[t]}.X`` (t: the first target layer calling the module)."""
    layer = layer_of(target_key)
    if layer is None:
        return target_key
    return f"layers.{layer_sources[layer]}.{target_key.split('.', 2)[2]}"


def slot_sizes(layer_keys: Sequence[int]) -> Dict[int, int]:
    """module key -> N, the number of layers that call it."""
    return dict(Counter(layer_keys))


def check_refinement(layer_sources: Sequence[int], target_keys: Sequence[int], source: str, target: str) -> None:
    """Every target module must be called only by layers whose source module is one and the same,
    else a target module would have two candidate weights (e.g. ``cycle:4 -> cycle:2``)."""
    origin: Dict[int, int] = {}
    for layer, (src, dst) in enumerate(zip(layer_sources, target_keys, strict=True)):
        if origin.setdefault(dst, src) != src:
            raise ConfigError(
                f"--target-share-pattern {target}: layers {dst} and {layer} share a module in the "
                f"target but come from different modules of the source ({source}); the target "
                "pattern must refine the source's (all -> cycle:K -> none)"
            )


def target_uses(layer_sources: Sequence[int], target_keys: Sequence[int]) -> Dict[int, int]:
    """source module -> how many target modules are copied from it (what a conversion must write)."""
    return dict(Counter(src for src, _ in dict.fromkeys(zip(layer_sources, target_keys, strict=True))))


def delink_moment(kind: str, tensor: torch.Tensor, source_uses: int, target_uses: int, mode: str) -> torch.Tensor:
    """One optimizer tensor of a target module called by ``target_uses`` layers, copied from a
    source module called by ``source_uses`` layers."""
    if mode not in OPTIMIZER_STATE_MODES or mode == "reset":
        raise ValueError(f"delink_moment: mode must be copy or rescale, got {mode!r}")
    if mode == "copy" or kind == "step" or source_uses == target_uses:
        return tensor
    if kind not in GRADIENT_POWER:
        raise ValueError(f"unknown optimizer state {kind!r}")
    power = GRADIENT_POWER[kind]  # the optimizer specs' (config/optimizers.py)
    return tensor * target_uses**power / source_uses**power


def add_noise(tensor: torch.Tensor, target_key: str, std: float, seed: int, relative: bool = False) -> torch.Tensor:
    """``tensor`` (a whole global piece) plus N(0, s^2) noise seeded by (seed, target_key), where
    s = ``std``, or ``std`` times the tensor's own std when ``relative``."""
    if relative:
        std = std * tensor.float().std().item() if tensor.numel() > 1 else 0.0
    if std <= 0:
        return tensor
    noisy = tensor + draw(f"delink-noise:{target_key}", tuple(tensor.shape), ("normal", std), seed).to(tensor.dtype)
    if not torch.isfinite(noisy).all():
        raise ConfigError(f"--noise-std {std:g} makes {target_key} non-finite in {tensor.dtype}; nothing was written")
    return noisy
