"""What a checkpoint costs: bytes each rank and node writes, the write time at a filesystem's
bandwidth, the training stall per save with and without ``--async-save``, and host memory
during the save (``async_save_host_bytes``: the asynchronous save's host copy, per rank).

The bytes are the format's (docs/checkpoint.md): every logical tensor's TP shard once, by the
ranks ``layout/ownership.py`` says store it (the description the checkpoint's tensor table and
parallel save read too), as fp32 weight, the optimizer's state entries (AdamW's two moments
and Lion's one of the weight's shape, Adafactor's factored statistics: a row and a column
value per matrix row and column) and a 4-byte step count, whatever dtypes training keeps
(safetensors headers, a few KiB per file, are not counted). Who writes follows
``checkpoint/io.py``: with one data-parallel rank or ``--no-ckpt-fully-parallel-save`` the
rank of expert-data-parallel index 0 writes each shard whole, having gathered it into host
memory; otherwise every rank writes what it owns — under the distributed optimizer its 1/DP of
the shard's flat state (1/expert-DP for experts; the estimate ignores bucket padding), without
it the pieces ``ownership.assign_writers`` gives it, as in the save (exact; the equal expert
pieces of a stacked parameter counted as shared evenly).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p2r.config import Config
from megatron_p2r.layout.offload import DTYPE_BYTES
from megatron_p2r.layout.ownership import StoredTensor, WrittenPiece, assign_writers, stored_tensors
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.optim.factored_form import matrix_view

FP32 = 4

# Default bandwidths, bytes/s. Aggregate: an assumed mid-size parallel filesystem (Lustre, GPFS)
# of 100 GB/s, not a measurement: set the cluster's own with --fs-write-bw. Per node: nothing
# below the node's network (its GPUs' --inter-node-bw together), over which the writes leave it.
FS_WRITE_BW = 100e9


@dataclass(frozen=True)
class Bandwidths:
    """The filesystem's write bandwidth (aggregate, and per node when it is not the network's)
    and the device -> host copy's (per GPU)."""

    fs_write: float
    fs_node_write: float
    host: float


def piece_bytes(cfg: Config, shape: Sequence[int], host_copy: bool = False) -> int:
    """Bytes of one stored TP shard of local ``shape``: the fp32 weight, the optimizer's entries
    (AdamW's two moments and Lion's one of the weight's shape; Adafactor's factored statistics,
    R + C values per matrix, ``optim/factored_form.py``) and a 4-byte step count. With
    ``host_copy``: ``--async-save``'s copy of them, which keeps the main parameter and the moments
    in the dtypes training holds them in (``--main-params-dtype``, ``--exp-avg-dtype``,
    ``--exp-avg-sq-dtype``; ``async_save.host_copy``)."""
    t, numel = cfg.train, math.prod(shape)
    if t.optimizer == "adafactor":
        matrices, rows, cols = matrix_view(shape)
        state = FP32 * matrices * (rows + cols)
    else:
        state = numel * sum(DTYPE_BYTES[d] if host_copy else FP32 for d in t.moment_dtypes)
    return (DTYPE_BYTES[t.main_params_dtype] if host_copy else FP32) * numel + state + FP32


def _owners(layout: Layout, mode: str, e: int, expert: bool, writer: int = 0) -> List[int]:
    """The data-parallel indices of the ranks writing a piece of EP file ``e``: the single
    writer (expert-data-parallel index 0), every replica (``distributed``: each its 1/DP), or
    the one ``ownership.assign_writers`` names (``writer``)."""
    index = {"single": [0], "distributed": range(layout.expert_dp if expert else layout.dp), "assigned": [writer]}
    return [e + layout.ep * i if expert else i for i in index[mode]]


class _Tally:
    """Bytes each rank writes, and the largest fp32 tensor it writes (what a parallel writer stages)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.bytes: Dict[int, float] = defaultdict(float)
        self.largest: Dict[int, int] = defaultdict(int)

    def add(self, t: int, stage: int, dps: List[int], size: float, largest: int) -> None:
        for d in dps:
            rank = self.layout.rank(t, d, stage)
            self.bytes[rank] += size
            self.largest[rank] = max(self.largest[rank], largest)


def rank_bytes(cfg: Config, layout: Layout, host_copy: bool = False) -> Dict[int, Tuple[float, int]]:
    """rank -> (bytes it writes, bytes of the largest tensor it writes) for one checkpoint of ``cfg``
    on ``layout``; ranks that write nothing are absent. With ``host_copy``: the bytes of
    ``--async-save``'s host copy of what it writes (``piece_bytes``), which always takes the
    fully parallel save's share, with one data-parallel rank too."""
    stored, tp = stored_tensors(ParallelPlan.model_parallel(cfg)), layout.tp
    dense = [st for st in stored if not st.spec.expert]
    parallel = host_copy or (cfg.checkpoint.ckpt_fully_parallel_save and layout.dp > 1)
    mode = ("distributed" if cfg.parallel.use_distributed_optimizer else "assigned") if parallel else "single"
    written = [WrittenPiece(st.logical, st.stage, 0, False, FP32 * math.prod(st.piece_shape(tp))) for st in dense]
    writers = assign_writers(written, layout.dp, layout.expert_dp) if mode == "assigned" else {}
    tally = _Tally(layout)
    for st in dense:
        local = st.spec.shape
        dps = _owners(layout, mode, 0, False, writers.get(st.logical, 0))
        for t in st.tp_ranks(tp):
            tally.add(t, st.stage, dps, piece_bytes(cfg, local, host_copy) / len(dps), FP32 * math.prod(local))
    _add_experts(cfg, layout, mode, tally, host_copy, [st for st in stored if st.spec.expert])
    return {r: (b, tally.largest[r]) for r, b in tally.bytes.items()}


def _add_experts(
    cfg: Config, layout: Layout, mode: str, tally: _Tally, host_copy: bool, experts: List[StoredTensor]
) -> None:
    """Expert pieces, per stacked parameter (in the file of its first stage, of each EP rank):
    its local experts are equal pieces, which the writers of a fully parallel save share evenly
    over the expert-data-parallel replicas (each writes all of them with expert-DP 1)."""
    for st in experts:
        one = tuple(st.spec.shape[1:])  # an expert's piece on its TP rank
        size = piece_bytes(cfg, one, host_copy) * st.spec.shape[0]
        for e in range(layout.ep):
            dps = _owners(layout, "distributed" if mode != "single" else mode, e, True)
            for t in st.tp_ranks(layout.tp):
                tally.add(t, st.stage, dps, size / len(dps), FP32 * math.prod(one))


def async_save_host_bytes(cfg: Config, layout: Layout) -> Dict[int, float]:
    """rank -> host memory of ``--async-save``'s copy of what it writes (none without the flag):
    every element it owns of its pieces — under the distributed optimizer its 1/DP of each shard
    (1/expert-DP of the experts'), else the whole pieces the save assigns it — in the dtypes
    training holds them in, and the step counts."""
    if not getattr(cfg.checkpoint, "async_save", False):
        return {}
    return {r: b for r, (b, _) in rank_bytes(cfg, layout, host_copy=True).items()}


def checkpoint_cost(cfg: Config, layout: Layout, gpus_per_node: int, bw: Bandwidths) -> dict:
    """The planner's checkpoint figures for ``cfg`` on ``layout`` (see the module docstring)."""
    per_rank = rank_bytes(cfg, layout)
    total = round(sum(b for b, _ in per_rank.values()))
    per_node: Dict[int, float] = defaultdict(float)
    for rank, (b, _) in per_rank.items():
        per_node[rank // gpus_per_node] += b
    rank_max = round(max(b for b, _ in per_rank.values()))
    node_max = round(max(per_node.values()))
    write = max(total / bw.fs_write, node_max / bw.fs_node_write)
    parallel = cfg.checkpoint.ckpt_fully_parallel_save and layout.dp > 1
    # A single writer gathers its whole shard into host memory; a parallel writer stages one
    # tensor at a time, and with --async-save (always the fully parallel save, which it needs)
    # also holds the host copy of everything it writes, which is what the training stall copies.
    staged = max(big for _, big in per_rank.values())
    copy = max(b for b, _ in rank_bytes(cfg, layout, host_copy=True).values())
    host = {"sync": staged if parallel else rank_max, "async": staged + copy}
    async_save: Optional[bool] = getattr(cfg.checkpoint, "async_save", None)
    return {
        "writers": "fully_parallel" if parallel else "single_writer",
        "total_bytes": total,
        "writing_ranks": len(per_rank),
        "rank_bytes_max": rank_max,
        "nodes": -(-layout.world_size // gpus_per_node),
        "node_bytes_max": node_max,
        "fs_write_bw": bw.fs_write,
        "fs_node_write_bw": bw.fs_node_write,
        "write_s": write,
        "stall_s": {"sync": write, "async": copy / bw.host},
        "host_bytes_during_save": host,
        "async_save": async_save,
    }
