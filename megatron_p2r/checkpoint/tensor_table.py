"""The tensor table: which pieces a model has, their global shapes and split dims, and which
shard file holds each of them for a given layout.

The unit of storage is a *piece*: one logical tensor (``layers.3.attention.qkv.weight``), or
one expert of a stacked expert parameter under its **global** index
(``layers.3.mlp.experts.7.weight1``). Each piece is stored exactly once per TP shard: in the
file of its first pipeline stage (a pipeline rank: with interleaving, the stage whose model
chunk holds the layer) (replicas on later stages — the tied output weight, a pseudo
slot used by several stages — are not written again), of TP rank 0 when it is not split over
TP, and of the EP rank that holds it (the rule: ``layout/ownership.py``). Data-parallel replicas therefore write once, and the
same table says where every piece is for any layout, which is what lets ``reshard`` and
``delink`` stream tensor by tensor.

Attention projections record the layout of their rows (``rows``, ``layout.tensor_specs.HeadRows``):
``groups`` blocks of heads. A TP split of such a piece cuts ``min(TP, groups)`` shards of whole
blocks; when TP exceeds the groups (grouped-query attention's key/value heads), TP/groups
consecutive ranks hold the same shard and only the first of them stores it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.naming import METADATA_FILE, entry_name, shard_file
from megatron_p2r.checkpoint.safetensors_io import nbytes
from megatron_p2r.config import Config
from megatron_p2r.layout.ownership import stored_tensors, storing_tp_ranks
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.sharing import slot_to_layers
from megatron_p2r.layout.tensor_specs import HeadRows
from megatron_p2r.optim.factored_form import FACTOR_KINDS, entry_shape
from megatron_p2r.parallel.sharding import expert_key


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One piece: where it comes from, its global shape and how it is split."""

    key: str  # name of the piece (expert pieces: expert_key(param, e))
    param: str  # logical parameter name (the stacked name for experts)
    shape: Tuple[int, ...]  # global shape of the piece (one expert's shape for experts)
    dtype: str  # safetensors dtype string
    tp_dim: Optional[int]  # dimension of ``shape`` split over TP, or None (stored by TP rank 0)
    expert: Optional[int]  # global expert index; the stacked parameter's dim 0 is split over EP
    stage: int  # pipeline stage whose file holds the piece
    module_key: Optional[int]  # K for pieces under ``layers.K.``
    layers: Tuple[int, ...]  # global layers that call module K (several in the pseudo phase)
    rows: Optional[HeadRows] = None  # attention projections: dim 0 as blocks of heads

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    def to_json(self) -> dict:
        out = {
            "param": self.param,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "tp_dim": self.tp_dim,
            "ep_dim": 0 if self.expert is not None else None,
            "expert": self.expert,
            "stage": self.stage,
            "module_key": self.module_key,
            "layers": list(self.layers),
        }
        if self.rows is not None:
            out["rows"] = self.rows.to_json()
        return out

    @classmethod
    def from_json(cls, key: str, d: dict) -> "TensorInfo":
        try:
            rows = HeadRows.from_json(d["rows"]) if d.get("rows") is not None else None
            return cls(
                key=key,
                param=d["param"],
                shape=tuple(d["shape"]),
                dtype=d["dtype"],
                tp_dim=d["tp_dim"],
                expert=d["expert"],
                stage=d["stage"],
                module_key=d["module_key"],
                layers=tuple(d["layers"]),
                rows=rows,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{METADATA_FILE}: tensors[{key!r}] is malformed ({exc!r})") from None


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What decides file placement: TP, PP, EP and the layers each pipeline stage holds.

    Files follow the physical pipeline stages (``PPP`` is the pipeline rank). ``stage_layers``
    lists the [start, stop) of each virtual stage in pipeline order: one per stage without
    interleaving; with v model chunks per rank, P x v of them, virtual stage i held by pipeline
    stage i mod P. So the JSON has the same fields whatever the interleaving.
    """

    tp: int
    pp: int
    ep: int
    stage_layers: Tuple[Tuple[int, int], ...]  # [start, stop) of each virtual stage
    num_experts: int = 0

    @classmethod
    def of(cls, cfg: Config) -> "ShardLayout":
        p = cfg.parallel
        return cls(
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            ep=p.expert_model_parallel_size,
            stage_layers=tuple(
                (c.layers.start, c.layers.stop) for c in ParallelPlan.model_parallel(cfg).virtual_stages
            ),
            num_experts=cfg.model.num_experts or 0,
        )

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "stage_layers": [list(r) for r in self.stage_layers]}

    def ep_rank_of(self, info: TensorInfo) -> int:
        return 0 if info.expert is None else info.expert // (self.num_experts // self.ep)

    def tp_shards(self, info: TensorInfo) -> int:
        """Distinct TP shards of the piece (fewer than TP for key/value heads replicated over TP)."""
        if info.tp_dim is None:
            return 1
        return info.rows.tp_shards(self.tp) if info.rows is not None else self.tp

    def tp_ranks_of(self, info: TensorInfo) -> range:
        """The TP ranks whose files store the piece: the first rank of each shard's replicas."""
        return storing_tp_ranks(self.tp, self.tp // self.tp_shards(info) if info.tp_dim is not None else None)

    def file_of(self, info: TensorInfo, tp_rank: int) -> str:
        """The file holding the shard TP rank ``tp_rank`` uses (shard 0 for unsplit pieces)."""
        if info.tp_dim is None:
            return shard_file(0, info.stage, self.ep_rank_of(info))
        replicas = self.tp // self.tp_shards(info)
        return shard_file(tp_rank - tp_rank % replicas, info.stage, self.ep_rank_of(info))

    def local_shape(self, info: TensorInfo) -> Tuple[int, ...]:
        shape = list(info.shape)
        if info.tp_dim is not None:
            shape[info.tp_dim] //= self.tp_shards(info)
        return tuple(shape)

    def entry_shape(self, info: TensorInfo, kind: str, broadcast: bool = False) -> Tuple[int, ...]:
        """The shape entry ``kind`` of the piece is stored with in a TP rank's file: the weight's
        local shape, Adafactor's factored statistics of it (``optim/factored_form.py``; with
        ``broadcast``, as checkpoints before them stored them, the weight's), () for the step."""
        if kind == "step":
            return ()
        local = self.local_shape(info)
        return entry_shape(local, kind) if kind in FACTOR_KINDS and not broadcast else local

    def stage_files(self, stage: int) -> List[str]:
        return [shard_file(t, stage, e) for e in range(self.ep) for t in range(self.tp)]

    def files(self) -> List[str]:
        return [f for s in range(self.pp) for f in self.stage_files(s)]


def tensor_table(cfg: Config, experts: bool = True) -> Dict[str, TensorInfo]:
    """Every piece of the model ``cfg`` describes, in file order (stage by stage), from the
    tensors the ParallelPlan's checkpoint ownership stores (``layout.ownership``; checked against meta-device builds of the model). Without
    ``experts``, the expert pieces are left out (a 10T model has millions of them, which the
    planner counts per stacked parameter instead)."""
    plan = ParallelPlan.model_parallel(cfg)
    tp, ep = plan.layout.tp, plan.layout.ep
    users = slot_to_layers(plan.layer_keys)
    table: Dict[str, TensorInfo] = {}
    for stored in stored_tensors(plan):
        spec, logical, mk = stored.spec, stored.logical, stored.spec.module_key
        if spec.expert and not experts:
            continue
        common = dict(
            param=logical,
            dtype="F32",
            stage=stored.stage,
            module_key=mk,
            layers=tuple(users.get(mk, ())) if mk is not None else (),
            shape=stored.piece_shape(tp),
        )
        if spec.expert:
            tp_dim = None if spec.tp_dim is None else spec.tp_dim - 1
            for e in range(spec.shape[0] * ep):
                key = expert_key(logical, e)
                table[key] = TensorInfo(key=key, expert=e, tp_dim=tp_dim, **common)
        else:
            table[logical] = TensorInfo(key=logical, expert=None, tp_dim=spec.tp_dim, rows=spec.rows, **common)
    return table


def file_entries(
    table: Dict[str, TensorInfo], layout: ShardLayout, kinds: Sequence[str], broadcast: bool = False
) -> Dict[str, list]:
    """file -> [(entry name, dtype, stored shape)] in write order, for every file of ``layout``
    (``broadcast``: Adafactor's statistics in the form of checkpoints before issue 37)."""
    out: Dict[str, list] = {f: [] for f in layout.files()}
    for info in table.values():
        for t in layout.tp_ranks_of(info):
            entries = out[layout.file_of(info, t)]
            for kind in kinds:
                dtype = "F32" if kind == "step" else info.dtype
                entries.append((entry_name(kind, info.key), dtype, layout.entry_shape(info, kind, broadcast)))
    return out
