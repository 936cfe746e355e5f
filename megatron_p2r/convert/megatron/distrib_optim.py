"""Megatron-LM's distributed optimizer state in the legacy layout (``--use-distributed-optimizer``
with ``--ckpt-format torch``): ``distrib_optim.pt`` beside each ``model_optim_rng.pt``.

DP rank 0 gathers every DP rank's shard into one flat fp32 tensor per state and grad buffer
(``DistributedOptimizer.get_parameter_state_dp_zero``):

    {"buckets_coalesced": True,
     0: {(param dtype, grad dtype): {"param": [N], "exp_avg": [N], "exp_avg_sq": [N], "numel_unpadded": N}},
     1: ...}                         (one grad buffer per model chunk, ``model0``, ``model1``, ...)

An MoE model under expert parallelism has two optimizers (megatron-core's ChainedOptimizer): the
file is then a list of two such dicts, the dense parameters' and the experts' (``legacy``). The
file does not say where a parameter
lies in its buffer; the buffer's layout does (``buffer_layout``, parameters in the order of the
model chunk's state dict, bucketed in the first chunk only); the flat tensor
keeps each bucket's elements and drops only the padding at bucket ends. We replay that layout
and check it against ``numel_unpadded`` before a value is read; each parameter's state is then a
view of the flat tensor, read on demand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.buffer_layout import Param, bucket_layout
from megatron_p2r.convert.megatron.unpickler import LazyTensor

FILE = "distrib_optim.pt"
# our optimizer-state kind -> the flat tensor's key ("param": the fp32 main weights)
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main": "param"}


def flat_offsets(params: List[Param], size: Optional[int]) -> Tuple[Dict[str, int], int]:
    """Each parameter's start in its buffer's flat tensor (the buckets without their end padding,
    one after another), and the tensor's length."""
    starts, lengths = bucket_layout(params, size)
    bases = [sum(lengths[:b]) for b in range(len(lengths))]
    return {key: bases[b] + rel for key, (b, rel) in starts.items()}, sum(lengths)


def state_views(
    state: object, buffers: List[Tuple[List[Param], Optional[int]]], path: str
) -> List[Dict[str, Dict[str, LazyTensor]]]:
    """For each of the rank's grad buffers (its parameters, its bucket size; one per model chunk),
    kind -> local key -> a view of that parameter's state in ``distrib_optim.pt`` (``state``, its
    unpickled dict)."""
    if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
        raise CheckpointError(
            f"{path}: not the distributed optimizer state Megatron-LM writes since core 0.8 "
            "(a dict with buckets_coalesced: True); older per-bucket files are not read"
        )
    saved = sorted(k for k in state if k != "buckets_coalesced")
    if saved != list(range(len(buffers))):
        raise CheckpointError(
            f"{path}: holds grad buffers {saved}, the model's parameters fill {len(buffers)} (one per model chunk)"
        )
    out = []
    for index, (params, size) in enumerate(buffers):
        flat = _single_dtype(state[index], f"{path}: buffer {index}")
        starts, total = flat_offsets(params, size)
        if flat.get("numel_unpadded") != total:
            raise CheckpointError(
                f"{path}: buffer {index} holds {flat.get('numel_unpadded')} elements, the layout of "
                f"the model's {len(params)} parameters in Megatron's buffer has {total}"
            )
        views: Dict[str, Dict[str, LazyTensor]] = {kind: {} for kind in STATES}
        for kind, name in STATES.items():
            tensor = flat.get(name)
            if not isinstance(tensor, LazyTensor) or tensor.shape != (total,) or tensor.stride != (1,):
                raise CheckpointError(
                    f"{path}: buffer {index}[{name!r}] is {tensor!r}, expected a flat tensor of {total} elements"
                )
            for p in params:
                views[kind][p.key] = dataclasses.replace(
                    tensor, offset=tensor.offset + starts[p.key], shape=p.shape, stride=_contiguous(p.shape)
                )
        out.append(views)
    return out


def groups_step(groups: object, where: str) -> float:
    """Adam's step count where the distributed optimizer keeps it: in each of its param groups
    (all equal; ``DistributedOptimizer.state_dict``)."""
    steps = {g.get("step") for g in groups if isinstance(g, dict)} if isinstance(groups, list) else set()
    if len(steps) != 1 or not isinstance(next(iter(steps)), (int, float)) or isinstance(next(iter(steps)), bool):
        raise CheckpointError(f"{where} give Adam steps {sorted(steps, key=str)}, expected one number")
    return float(steps.pop())


def _single_dtype(buffer: object, where: str) -> dict:
    if not isinstance(buffer, dict) or len(buffer) != 1:
        raise CheckpointError(f"{where}: expected one (param dtype, grad dtype) entry, found {buffer!r}")
    flat = next(iter(buffer.values()))
    if not isinstance(flat, dict):
        raise CheckpointError(f"{where}: expected a dict of flat tensors, found {type(flat).__name__}")
    return flat


def _contiguous(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
