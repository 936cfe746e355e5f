"""Whether a plan fits, tier by tier: the GPU (the rank that needs the most device memory), the
host (the node whose GPUs keep the most offloaded state in its memory) and, with
--cpu-offload-optimizer-nvme-path, the NVMe (the node whose GPUs keep the most optimizer state
on its local disks). A plan fits only when every tier does; the verdict names each tier that
overflows and by how much."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from megatron_p2r.layout.ranks import Layout
from megatron_p2r.planning.hardware import GiB, GPUSpec


@dataclass
class TierVerdict:
    """One memory tier: what its most loaded unit (a rank, a node) needs against its capacity."""

    tier: str  # "GPU", "host" or "NVMe"
    unit: str  # what one capacity belongs to: "rank" or "node"
    where: str  # the most loaded unit
    need: int  # bytes
    capacity: int  # bytes
    over: int  # bytes beyond the capacity (0 when it fits)
    fits: bool


def _tier(tier: str, unit: str, where: str, need: int, capacity: int) -> TierVerdict:
    return TierVerdict(
        tier=tier,
        unit=unit,
        where=where,
        need=need,
        capacity=capacity,
        over=max(need - capacity, 0),
        fits=need <= capacity,
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def gpu_tier(device_totals: List[int], layout: Layout, gpu: GPUSpec) -> TierVerdict:
    """The device tier: ``device_totals[stage]`` is what a rank of that stage needs."""
    stage = max(range(len(device_totals)), key=device_totals.__getitem__)
    where = f"rank {layout.rank(0, 0, stage)} (stage {stage})"
    return _tier("GPU", "rank", where, device_totals[stage], gpu.memory)


def host_tier(host_per_rank: List[int], layout: Layout, gpu: GPUSpec) -> TierVerdict:
    """The host tier: ``host_per_rank[stage]`` is what a rank of that stage offloads; a node's
    consecutive ranks share its memory."""
    return node_tier("host", host_per_rank, layout, gpu.gpus_per_node, gpu.host_memory_per_node)


def node_tier(tier: str, per_rank: List[int], layout: Layout, gpus_per_node: int, capacity: int) -> TierVerdict:
    """A tier a node's consecutive ranks share: ``per_rank[stage]`` is what a rank of that stage
    keeps there; the most loaded node against ``capacity``."""
    need, where = -1, ""
    for first in range(0, layout.world_size, gpus_per_node):
        ranks = range(first, min(first + gpus_per_node, layout.world_size))
        held = sum(per_rank[layout.coords(r).pp] for r in ranks)
        if held > need:
            need, where = held, f"node {first // gpus_per_node} (ranks {_ranks_text(ranks)})"
    return _tier(tier, "node", where, need, capacity)


def host_problem(host: TierVerdict) -> str:
    return (
        f"does not fit on host: {host.where} holds {host.need / GiB:.1f} GiB of offloaded state, "
        f"{host.over / GiB:.1f} GiB more than its {host.capacity / GiB:.1f} GiB of host memory "
        "(--host-memory per GPU or --host-memory-per-node sets it)"
    )


def nvme_problem(nvme: TierVerdict) -> str:
    return (
        f"does not fit on NVMe: {nvme.where} keeps {nvme.need / GiB:.1f} GiB of optimizer state on local disk, "
        f"{nvme.over / GiB:.1f} GiB more than its {nvme.capacity / GiB:.1f} GiB (--nvme-per-node sets it)"
    )


def verdict_line(tiers: Dict[str, TierVerdict]) -> str:
    """'FITS' or 'DOES NOT FIT', then each tier (overflowing ones first): by how much it
    overflows, which rank or node needs the most, and of what capacity."""
    parts = [
        f"{t.tier} {'fits' if t.fits else f'overflows by {t.over / GiB:.2f} GiB'}: {t.where} needs "
        f"{t.need / GiB:.2f} of {t.capacity / GiB:.2f} GiB"
        for t in sorted(tiers.values(), key=lambda t: t.fits)
    ]
    return ("FITS" if all(t.fits for t in tiers.values()) else "DOES NOT FIT") + ": " + "; ".join(parts)
