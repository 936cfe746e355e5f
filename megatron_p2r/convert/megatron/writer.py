"""Megatron-LM's two checkpoint layouts, written from canonical tensors (names.py): what
``megatron/training/checkpointing.py`` and megatron-core's ``dist_checkpointing`` read.

torch_dist (Megatron's default): ``metadata.json`` (sharded_backend torch_dist), ``common.pt``
(args, iteration, ...) and the sharded keys saved through ``torch.distributed.checkpoint``
(``.metadata`` + ``__0_0.distcp``), each key one global chunk, which Megatron reads into any
TP/PP/EP. Beside the weights, megatron-core's linear layers ask for an ``_extra_state`` object
per layer (and expert): written as megatron-core writes them for the local layer spec, the
bytes of ``torch.save([None])``.

Legacy (``--ckpt-format torch``): one ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per rank of
the layout, that rank's state dict under local names (layers from 0 on every stage, experts
from 0 on every EP rank, TP shards; SwiGLU fc1 shards are [their gate; their up]) with each
linear layer's ``_extra_state`` None, as ``load_state_dict(strict=True)`` expects.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

from megatron_p2r.convert.megatron.dist import COMMON_FILE, CONFIG_FILE, OPTIMIZER_KEYS
from megatron_p2r.convert.megatron.export_args import MegatronLayout
from megatron_p2r.convert.megatron.legacy import MODEL_FILE, rank_dir
from megatron_p2r.convert.megatron.names import (
    MTP_LAYER,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    DistNaming,
    dist_key,
    is_glu_fc1,
    split_layer_key,
    tp_dim,
)

DIST_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# the linear layers of a layer (or MTP depth): megatron-core asks for an _extra_state object of each
_LINEAR_WEIGHT = re.compile(
    r"((?:decoder|mtp)\.layers\..*\.(?:linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_q_proj"
    r"|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj|eh_proj))\.weight"
)
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(.+)")


def _stacked(tensors: Dict[str, torch.Tensor], naming: DistNaming, prefix: str = "") -> dict:
    """megatron-core's sharded keys (``prefix`` + key, as ``naming`` says) of ``tensors``
    (canonical name -> global tensor), which it empties as it stacks them, with the
    ``_extra_state`` objects of the model's linear layers (``prefix`` empty)."""
    keys: Dict[str, Dict[Tuple[int, ...], str]] = {}
    for name in list(tensors):
        key, index = dist_key(name, naming)
        keys.setdefault(key, {})[index] = name
    state: dict = {}
    for key, names in keys.items():
        if list(names) == [()]:
            state[prefix + key] = tensors.pop(names[()])
            shape = (1,)  # one shard of one: a layer's own key
        else:
            shape = tuple(max(i[d] for i in names) + 1 for d in range(len(next(iter(names)))))
            state[prefix + key] = torch.stack([tensors.pop(names[i]) for i in sorted(names)]).unflatten(0, shape)
        module = _LINEAR_WEIGHT.fullmatch(key)
        if module and not prefix:
            for index in sorted(names):
                shard = f"{'.'.join(map(str, index or (0,)))}_{'.'.join(map(str, shape))}"
                state[f"{module.group(1)}._extra_state/shard_{shard}"] = [None]  # DCP torch.saves an object
    return state


def write_dist(
    iter_dir: str,
    tensors: Dict[str, torch.Tensor],
    common: dict,
    optimizer: Optional[Dict[str, Dict[str, torch.Tensor]]] = None,
    naming: DistNaming = DistNaming(),
) -> None:
    """The torch_dist iteration directory of ``tensors`` (canonical name -> global tensor) and
    the ``optimizer`` state (kind -> canonical name -> tensor, under the non-distributed
    optimizer's prefix of ``OPTIMIZER_KEYS``, the first), keyed as ``naming`` says,
    emptied as they are stacked: at most one stacked key more than they hold is in memory."""
    state = _stacked(tensors, naming)
    for kind, kind_tensors in (optimizer or {}).items():
        state.update(_stacked(kind_tensors, naming, OPTIMIZER_KEYS[kind][0]))
    with warnings.catch_warnings():  # one writer by design, not a missing process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(iter_dir), no_dist=True)
    torch.save(common, os.path.join(iter_dir, COMMON_FILE))
    with open(os.path.join(iter_dir, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(DIST_CONFIG, fh)


def _shard(name: str, tensor: torch.Tensor, t: int, tp: int, glu: bool) -> torch.Tensor:
    """TP rank ``t``'s shard of a global tensor, as Megatron's local layers hold it."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return tensor.clone()
    if glu and is_glu_fc1(name):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
    return tensor.chunk(tp, dim)[t].clone()


def _local_name(name: str, p: int, e: int, layout: MegatronLayout, num_layers: int, experts: int):
    """The name rank (stage ``p``, EP rank ``e``) stores ``name`` under, or None if it does not hold it."""
    split, mtp = split_layer_key(name), MTP_LAYER.fullmatch(name)
    if mtp is None and (split is None or split[0] is None):
        first = name.startswith("embedding.")
        return name if (p == 0 if first else p == layout.pp - 1) else None
    per_stage = num_layers // layout.pp
    prefix, rest = (mtp.group(1), mtp.group(2)) if mtp else (None, split[1])
    if (p != layout.pp - 1) if mtp else (split[0] // per_stage != p):  # MTP layers: on the last stage
        return None
    expert = _EXPERT.fullmatch(rest)
    if expert:
        local = experts // layout.ep
        if int(expert.group(1)) // local != e:
            return None
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) % local}.{expert.group(2)}"
    return f"{prefix or f'decoder.layers.{split[0] % per_stage}.'}{rest}"


def _rank_model(
    tensors: Dict[str, torch.Tensor],
    rank: Tuple[int, int, int],
    layout: MegatronLayout,
    num_layers: int,
    experts: int,
    glu: bool,
) -> dict:
    t, p, e = rank
    model: dict = {}
    for name, tensor in tensors.items():
        local = _local_name(name, p, e, layout, num_layers, experts)
        if local is None:
            continue
        model[local] = _shard(name, tensor, t, layout.tp, glu)
        module = _LINEAR_WEIGHT.fullmatch(local)
        if module:
            model[f"{module.group(1)}._extra_state"] = None
    if p == layout.pp - 1:
        if OUTPUT_LAYER not in tensors and layout.pp > 1:  # the last stage's copy of the tied embedding
            model[OUTPUT_LAYER] = _shard(WORD_EMBEDDINGS, tensors[WORD_EMBEDDINGS], t, layout.tp, glu)
        model["output_layer._extra_state"] = None
    return model


def write_legacy(
    iter_dir: str,
    tensors: Dict[str, torch.Tensor],
    header: dict,
    layout: MegatronLayout,
    num_layers: int,
    experts: int,
    glu: bool,
) -> None:
    """The mp_rank_* files of every rank of ``layout``."""
    shape = (layout.tp, layout.pp, layout.ep)
    for p in range(layout.pp):
        for e in range(layout.ep):
            for t in range(layout.tp):
                directory = os.path.join(iter_dir, rank_dir(t, p, e, shape))
                os.makedirs(directory)
                model = _rank_model(tensors, (t, p, e), layout, num_layers, experts, glu)
                torch.save({**header, "model": model}, os.path.join(directory, MODEL_FILE))
