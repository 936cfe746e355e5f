"""Where Megatron-LM's distributed optimizer keeps each parameter's state: the layout of its DDP
param-and-grad buffer (megatron/core/distributed/param_and_grad_buffer.py, ``_ParamAndGradBuffer``).

The buffer holds a rank's parameters of one kind (dense, or the experts') in reverse order of
``named_parameters`` (roughly the order backprop produces their gradients). Each parameter starts
at a multiple of 64 elements (128-byte aligned); a bucket is closed once it holds ``bucket_size``
elements or more, and a pipeline-tied embedding (``shared_embedding``) gets a bucket of its own.
Each bucket's end is then padded to a multiple of lcm(DP, 128); that padding is not saved.
Neither checkpoint layout says where a parameter lies, so the layout is replayed and checked
against the sizes the checkpoint does record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from megatron_p2r.convert.megatron.args import SavedArgs

PARAM_ALIGNMENT = 64  # elements: every parameter starts 128-byte aligned


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter of one rank's module, as its buffer sees it."""

    key: str  # the name the caller knows it by
    shape: Tuple[int, ...]  # the rank's local shape (its TP shard)
    expert: bool  # in the experts' buffer (Megatron's ``allreduce=False``)
    own_bucket: bool = False  # a pipeline-tied embedding (``shared_embedding``): a bucket of its own


def bucket_size(args: SavedArgs, stage: int) -> Optional[int]:
    """Megatron's DDP bucket size (``DistributedDataParallel.__init__``); None: one bucket."""
    if stage > 0 or not args.get("overlap_grad_reduce"):
        return None
    return args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * (args.get("data_parallel_size") or 1))


def bucket_layout(params: List[Param], size: Optional[int]) -> Tuple[Dict[str, Tuple[int, int]], List[int]]:
    """Each parameter's (bucket, start within the bucket) for the buffer of ``params`` (in
    ``named_parameters`` order), and each bucket's length without its end padding (Megatron's
    ``numel_unpadded``)."""
    starts: Dict[str, Tuple[int, int]] = {}
    lengths: List[int] = []
    rel = 0  # the next position inside the open bucket
    opened = False
    for p in reversed(params):
        rel = math.ceil(rel / PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        if p.own_bucket and opened:
            lengths.append(rel)
            rel, opened = 0, False
        starts[p.key] = (len(lengths), rel)
        rel += math.prod(p.shape)
        opened = True
        if (size is not None and rel >= size) or p.own_bucket:
            lengths.append(rel)
            rel, opened = 0, False
    if opened:
        lengths.append(rel)
    return starts, lengths
