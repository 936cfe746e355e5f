"""How each parameter is split over TP and EP, and layout-invariant initialisation.

Every parameter carries a few attributes set where it is created:

    tp_dim      dimension split over TP ranks, or None when replicated
    tp_replicas consecutive TP ranks holding the same shard (key/value heads when TP > groups):
                the tensor splits into TP/tp_replicas shards, rank t holds shard t // tp_replicas
    expert      True for stacked expert weights ``[E_local, ...]`` (dim 0 split over EP)
    init        ("normal", std) | ("zeros",) | ("ones",)
    no_wd       True for norms and biases (no weight decay)
    shared_name the logical name when this parameter is a replica of another (tied output)

The module path of a parameter is its *global* name (layers are keyed by global layer or slot
index), so a name plus these attributes say exactly which slice of which logical tensor a rank
holds. Initialisation draws each logical tensor whole — one expert at a time for experts —
from a generator seeded by (seed, name) and keeps this rank's slice: the same seed gives the
same model for every layout. The checkpoint format uses the same functions.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Tuple

import torch
from torch import nn


def make_param(
    shape,
    *,
    tp_dim: Optional[int] = None,
    init=("normal", 0.02),
    expert: bool = False,
    no_wd: bool = False,
    tp_replicas: int = 1,
    device=None,
    dtype=torch.float32,
) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    p.tp_dim, p.init, p.expert, p.no_wd, p.tp_replicas = tp_dim, init, expert, no_wd, tp_replicas
    return p


def logical_name(name: str, param: nn.Parameter) -> str:
    return getattr(param, "shared_name", None) or name


def expert_key(name: str, expert: int) -> str:
    """Name of global expert ``expert``'s slice of a stacked expert parameter."""
    prefix, _, leaf = name.rpartition(".")
    return f"{prefix}.{expert}.{leaf}"


def global_shape(param: torch.Tensor, tp_size: int, ep_size: int = 1) -> Tuple[int, ...]:
    """Shape of the logical tensor (stacked over all experts) this rank holds a slice of."""
    shape = list(param.shape)
    tp_dim = getattr(param, "tp_dim", None)
    if tp_dim is not None:
        shape[tp_dim] *= tp_size // getattr(param, "tp_replicas", 1)
    if getattr(param, "expert", False):
        shape[0] *= ep_size
    return tuple(shape)


def tp_slice(
    full: torch.Tensor, tp_dim: Optional[int], tp_rank: int, tp_size: int, tp_replicas: int = 1
) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``full``: one of TP/tp_replicas chunks along ``tp_dim``."""
    shards = tp_size // tp_replicas
    if tp_dim is None or shards == 1:
        return full
    return full.chunk(shards, dim=tp_dim)[tp_rank // tp_replicas]


def local_experts(param: nn.Parameter, ep_rank: int) -> range:
    n = param.shape[0]
    return range(ep_rank * n, (ep_rank + 1) * n)


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def draw(key: str, shape, init, seed: int) -> torch.Tensor:
    """The full logical tensor ``key`` as initialisation defines it (fp32, CPU)."""
    kind = init[0]
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "normal":
        return torch.empty(shape).normal_(0.0, init[1], generator=_generator(seed, key))
    raise ValueError(f"unknown init {init!r} for {key}")


def init_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int, ep_rank: int = 0) -> None:
    """Fill every parameter with its slice of the layout-invariant initial model."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            key = logical_name(name, param)
            tp_dim = getattr(param, "tp_dim", None)
            if getattr(param, "expert", False):
                per_expert = list(param.shape[1:])
                if tp_dim is not None:  # tp_dim counts the stacked expert dimension
                    per_expert[tp_dim - 1] *= tp_size
                for j, e in enumerate(local_experts(param, ep_rank)):
                    full = draw(expert_key(key, e), per_expert, param.init, seed)
                    sub_dim = None if tp_dim is None else tp_dim - 1
                    param[j].copy_(tp_slice(full, sub_dim, tp_rank, tp_size))
            else:
                full = draw(key, global_shape(param, tp_size), param.init, seed)
                param.copy_(tp_slice(full, tp_dim, tp_rank, tp_size, getattr(param, "tp_replicas", 1)))
