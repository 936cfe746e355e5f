"""Megatron-LM's non-distributed optimizer state in the legacy layout: ``model_optim_rng.pt``'s
``optimizer`` is the torch Adam state dict of the rank's parameters,

    {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{"params": [i, ...], "wd_mult", ...}]}

indices numbered group after group. A group holds the parameters of one key of Megatron's
``_get_param_groups``: no weight decay (``wd_mult`` 0) for biases and 1-D parameters (norms),
experts apart (``is_expert_parallel``), each in ``named_parameters`` order (the rank's ``model``
state dict order). Each moment's shape is checked against its parameter's before it is used.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.unpickler import LazyTensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def _group_key(key: str, shape: Tuple[int, ...], expert: bool) -> Tuple[bool, bool]:
    return (key.endswith(".bias") or len(shape) == 1, expert)


def not_read(optimizer: object, path: str) -> str:
    """Why an ``optimizer`` entry that is not torch Adam's plain state dict is not read."""
    what = f"a dict of {sorted(map(str, optimizer))}" if isinstance(optimizer, dict) else type(optimizer).__name__
    return (
        f"{path}: optimizer is {what}, not torch Adam's state dict (state, param_groups); the --bf16/--fp16 "
        "optimizer's (with fp32_from_fp16_params) and MoE's chained optimizers' are not read yet"
    )


def state_views(
    optimizer: object, params: List[Tuple[str, Tuple[int, ...], bool]], path: str
) -> Optional[Tuple[Dict[str, Dict[str, LazyTensor]], float]]:
    """(kind -> local key -> the moment, Adam's step) of the rank's ``params`` (local key, shape,
    expert) in state-dict order; None when ``optimizer`` is not a plain Adam state dict (the
    fp16/bf16 optimizer's nested one is not read)."""
    if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"}:
        return None
    state, groups = optimizer["state"], optimizer["param_groups"]
    members: Dict[Tuple[bool, bool], List[Tuple[str, Tuple[int, ...]]]] = {}
    for key, shape, expert in params:
        members.setdefault(_group_key(key, shape, expert), []).append((key, shape))
    views: Dict[str, Dict[str, LazyTensor]] = {kind: {} for kind in MOMENTS}
    steps = set()
    for n, group in enumerate(groups):
        where = f"{path}: optimizer.param_groups[{n}]"
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointError(f"{where} is not a param group with a list of params")
        mine = members.pop((group.get("wd_mult", 1.0) == 0.0, bool(group.get("is_expert_parallel"))), [])
        if len(mine) != len(group["params"]):
            raise CheckpointError(
                f"{where} holds {len(group['params'])} parameters, the model's "
                f"{'no-' if group.get('wd_mult') == 0.0 else ''}weight-decay group has {len(mine)}"
            )
        for index, (key, shape) in zip(group["params"], mine, strict=True):
            entry = state.get(index) if isinstance(state, dict) else None
            for kind in MOMENTS:
                tensor = entry.get(kind) if isinstance(entry, dict) else None
                if not isinstance(tensor, LazyTensor) or tuple(tensor.shape) != shape:
                    got = f"of shape {list(tensor.shape)}" if isinstance(tensor, LazyTensor) else repr(tensor)
                    raise CheckpointError(
                        f"{path}: optimizer.state[{index}][{kind!r}] is {got}, expected a tensor "
                        f"of {key}'s shape {list(shape)}"
                    )
                views[kind][key] = tensor
            step = entry.get("step")
            steps.add(float(step.read().reshape(())) if isinstance(step, LazyTensor) else step)
    steps = {float(s) if isinstance(s, int) and not isinstance(s, bool) else s for s in steps}
    if members:
        raise CheckpointError(f"{path}: optimizer.param_groups have no group for {next(iter(members.values()))[0][0]}")
    if len(steps) != 1 or not isinstance(next(iter(steps)), float):
        raise CheckpointError(f"{path}: optimizer.state gives Adam steps {sorted(steps, key=str)}, expected one number")
    return views, steps.pop()
