"""Megatron-LM's distributed optimizer state in the legacy layout (``--use-distributed-optimizer``
with ``--ckpt-format torch``): ``distrib_optim.pt`` beside each ``model_optim_rng.pt``.

DP rank 0 gathers every DP rank's shard into one flat fp32 tensor per state and grad buffer
(``DistributedOptimizer.get_parameter_state_dp_zero``):

    {"buckets_coalesced": True,
     0: {(param dtype, grad dtype): {"param": [N], "exp_avg": [N], "exp_avg_sq": [N], "numel_unpadded": N}},
     1: ...}                         (buffer 0: dense parameters; then the experts' buffer)

The file does not say where a parameter lies in its buffer; the buffer's layout does
(``_ParamAndGradBuffer``): parameters in reverse order of ``named_parameters`` (the order of the
rank's ``model`` state dict), each starting at a multiple of 64 elements, buckets closed after
``bucket_size`` elements and around a pipeline-tied embedding; the flat tensor keeps each
bucket's elements and drops only the padding at bucket ends. We replay that layout and check
it against ``numel_unpadded`` before a value is read; each parameter's state is then a view of
the flat tensor, read on demand.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.args import SavedArgs
from megatron_p2r.convert.megatron.unpickler import LazyTensor

FILE = "distrib_optim.pt"
PARAM_ALIGNMENT = 64  # elements: every parameter starts 128-byte aligned
# our optimizer-state kind -> the flat tensor's key ("param": the fp32 main weights)
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main": "param"}


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter of one rank's module, as its buffer sees it."""
    key: str                  # its local key in the rank's ``model`` state dict
    shape: Tuple[int, ...]
    expert: bool              # in the experts' buffer (Megatron's ``allreduce=False``)
    own_bucket: bool = False  # a pipeline-tied embedding (``shared_embedding``): a bucket of its own


def bucket_size(args: SavedArgs, stage: int) -> Optional[int]:
    """Megatron's DDP bucket size (``DistributedDataParallel.__init__``); None: one bucket."""
    if stage > 0 or not args.get("overlap_grad_reduce"):
        return None
    return args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * (args.get("data_parallel_size") or 1))


def flat_offsets(params: List[Param], size: Optional[int]) -> Tuple[Dict[str, int], int]:
    """Each parameter's start in its buffer's flat tensor, and the tensor's length."""
    starts: Dict[str, int] = {}
    base = rel = 0  # the open bucket's start in the flat tensor; the next position inside it
    opened = False
    for p in reversed(params):
        rel = math.ceil(rel / PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        if p.own_bucket and opened:
            base, rel, opened = base + rel, 0, False
        starts[p.key] = base + rel
        rel += math.prod(p.shape)
        opened = True
        if (size is not None and rel >= size) or p.own_bucket:
            base, rel, opened = base + rel, 0, False
    return starts, base + rel


def state_views(state: object, params: List[Param], size: Optional[int], path: str) -> Dict[str, Dict[str, LazyTensor]]:
    """kind -> local key -> a view of that parameter's state in ``distrib_optim.pt`` (``state``,
    its unpickled dict)."""
    if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
        raise CheckpointError(f"{path}: not the distributed optimizer state Megatron-LM writes since core 0.8 "
                              "(a dict with buckets_coalesced: True); older per-bucket files are not read")
    groups = [[p for p in params if not p.expert], [p for p in params if p.expert]]
    groups = [g for g in groups if g]
    buffers = sorted(k for k in state if k != "buckets_coalesced")
    if buffers != list(range(len(groups))):
        raise CheckpointError(f"{path}: holds grad buffers {buffers}, the model's parameters fill "
                              f"{len(groups)} (dense{', experts' if len(groups) > 1 else ''})")
    views: Dict[str, Dict[str, LazyTensor]] = {kind: {} for kind in STATES}
    for index, group in enumerate(groups):
        flat = _single_dtype(state[index], f"{path}: buffer {index}")
        starts, total = flat_offsets(group, size)
        if flat.get("numel_unpadded") != total:
            raise CheckpointError(f"{path}: buffer {index} holds {flat.get('numel_unpadded')} elements, the layout of "
                                  f"the model's {len(group)} parameters in Megatron's buffer has {total}")
        for kind, name in STATES.items():
            tensor = flat.get(name)
            if not isinstance(tensor, LazyTensor) or tensor.shape != (total,) or tensor.stride != (1,):
                raise CheckpointError(f"{path}: buffer {index}[{name!r}] is {tensor!r}, expected a flat tensor of "
                                      f"{total} elements")
            for p in group:
                views[kind][p.key] = dataclasses.replace(tensor, offset=tensor.offset + starts[p.key], shape=p.shape,
                                                         stride=_contiguous(p.shape))
    return views


def _single_dtype(buffer: object, where: str) -> dict:
    if not isinstance(buffer, dict) or len(buffer) != 1:
        raise CheckpointError(f"{where}: expected one (param dtype, grad dtype) entry, found {buffer!r}")
    flat = next(iter(buffer.values()))
    if not isinstance(flat, dict):
        raise CheckpointError(f"{where}: expected a dict of flat tensors, found {type(flat).__name__}")
    return flat


def _contiguous(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
