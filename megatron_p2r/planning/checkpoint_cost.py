"""What a checkpoint costs: bytes each rank and node writes, the write time at a filesystem's
bandwidth, the training stall per save with and without ``--async-save``, and host memory
during the save.

The bytes are the format's (``checkpoint/tensor_table.py``, docs/checkpoint.md): every piece's
TP shard once, as fp32 weight, the optimizer's state entries of the weight's shape (AdamW's
two moments, Lion's one, Adafactor's two broadcast statistics) and a 4-byte step count,
whatever dtypes training keeps (safetensors headers, a few KiB per file, are not counted). Who writes follows
``checkpoint/io.py``: with one data-parallel rank or ``--no-ckpt-fully-parallel-save`` the
rank of expert-data-parallel index 0 writes each shard whole, having gathered it into host
memory; otherwise every rank writes what it owns — under the distributed optimizer its 1/DP of
the shard's flat state (1/expert-DP for experts; the estimate ignores bucket padding), without
it the pieces ``parallel_save.assign_writers`` gives it (exact; the equal expert pieces of a
stacked parameter counted as shared evenly).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_p2r.checkpoint.parallel_save import assign_writers
from megatron_p2r.checkpoint.tensor_table import ShardLayout, tensor_table
from megatron_p2r.config import Config
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.optim.optimizer import OPTIMIZER_KINDS

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


def tensors_per_piece(cfg: Config) -> int:
    """fp32 tensors of a piece's shape a checkpoint stores: the weight and the optimizer's entries."""
    return len(OPTIMIZER_KINDS[cfg.train.optimizer])   # its entries but the step count, plus the weight


def piece_bytes(numel: int, tensors: int) -> int:
    """Bytes one stored TP shard of ``numel`` elements takes: ``tensors`` fp32 tensors, a step count."""
    return tensors * FP32 * numel + FP32


def _tensor(piece: int, tensors: int) -> int:
    """Bytes of one fp32 tensor (weight or optimizer entry) of a piece of ``piece`` bytes."""
    return (piece - FP32) // tensors


def _owners(layout: Layout, mode: str, e: int, expert: bool, writer: int = 0) -> List[int]:
    """The data-parallel indices of the ranks writing a piece of EP file ``e``: the single
    writer (expert-data-parallel index 0), every replica (``distributed``: each its 1/DP), or
    the one ``parallel_save.assign_writers`` names (``writer``)."""
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


def rank_bytes(cfg: Config, layout: Layout) -> Dict[int, Tuple[float, int]]:
    """rank -> (bytes it writes, bytes of the largest tensor it writes) for one checkpoint of ``cfg``
    on ``layout``; ranks that write nothing are absent."""
    table, shards = tensor_table(cfg, experts=False), ShardLayout.of(cfg)
    parallel = cfg.checkpoint.ckpt_fully_parallel_save and layout.dp > 1
    mode = ("distributed" if cfg.parallel.use_distributed_optimizer else "assigned") if parallel else "single"
    writers = assign_writers(table, shards, layout.dp, layout.expert_dp) if mode == "assigned" else {}
    tally, tensors = _Tally(layout), tensors_per_piece(cfg)
    for info in table.values():
        size = piece_bytes(math.prod(shards.local_shape(info)), tensors)
        dps = _owners(layout, mode, 0, False, writers.get(info.key, 0))
        for t in shards.tp_ranks_of(info):
            tally.add(t, info.stage, dps, size / len(dps), _tensor(size, tensors))
    _add_experts(cfg, layout, mode, tally)
    return {r: (b, tally.largest[r]) for r, b in tally.bytes.items()}


def _add_experts(cfg: Config, layout: Layout, mode: str, tally: _Tally) -> None:
    """Expert pieces, per stacked parameter (in the file of its first stage, of each EP rank):
    its local experts are equal pieces, which the writers of a fully parallel save share evenly."""
    plan, seen = ParallelPlan.model_parallel(cfg), set()
    for stage in range(len(plan.stages)):
        for spec in plan.tensors(stage):
            if not spec.expert or spec.logical in seen:
                continue
            seen.add(spec.logical)
            one = piece_bytes(spec.numel // spec.shape[0], tensors_per_piece(cfg))
            for e in range(layout.ep):
                dps = _owners(layout, "distributed" if mode != "single" else mode, e, True)
                for t in range(layout.tp) if spec.tp_dim is not None else range(1):
                    tally.add(t, stage, dps, one * spec.shape[0] / len(dps), _tensor(one, tensors_per_piece(cfg)))


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
    # A single writer gathers its whole shard into host memory (with --async-save that gathered
    # copy is what the background writer writes); a parallel writer stages one tensor at a time,
    # and with --async-save also holds the host copy of everything it writes.
    staged = max(big for _, big in per_rank.values())
    host = {"sync": staged, "async": staged + rank_max} if parallel else {"sync": rank_max, "async": rank_max}
    async_save: Optional[bool] = getattr(cfg.checkpoint, "async_save", None)
    return {"writers": "fully_parallel" if parallel else "single_writer",
            "total_bytes": total, "writing_ranks": len(per_rank), "rank_bytes_max": rank_max,
            "nodes": -(-layout.world_size // gpus_per_node), "node_bytes_max": node_max,
            "fs_write_bw": bw.fs_write, "fs_node_write_bw": bw.fs_node_write, "write_s": write,
            "stall_s": {"sync": write, "async": rank_max / bw.host},
            "host_bytes_during_save": host,
            "async_save": async_save}
