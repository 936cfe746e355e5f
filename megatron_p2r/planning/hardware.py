"""The accelerators the planner knows: memory, peak FLOP/s and link bandwidths of each preset,
and the node it sits in (GPUs per node, host memory per node: offloaded state lives there; local
NVMe per node: the optimizer state of offloaded layers with --cpu-offload-optimizer-nvme-path)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional

GiB = 2**30
TiB = 2**40


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator, its links and its node. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    memory: int  # bytes usable by the process (as nvidia-smi reports the total)
    flops16: float  # dense bf16/fp16 tensor-core FLOP/s
    flops32: float  # dense fp32 FLOP/s (TF32 off)
    hbm_bw: float  # device memory bandwidth (the optimizer step is bound by it)
    intra_node_bw: float  # NVLink, per GPU
    inter_node_bw: float  # network, per GPU (node NIC bandwidth / GPUs per node)
    host_bw: float  # PCIe host <-> device, per GPU
    host_memory_per_node: int  # host DRAM of one node, shared by its GPUs' offloaded state
    gpus_per_node: int = 8
    bf16: bool = True  # V100 has fp16 tensor cores but no bf16

    def replace(self, **changes) -> "GPUSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def with_node(
        self,
        gpus_per_node: Optional[int] = None,
        host_memory_per_gpu: Optional[int] = None,
        host_memory_per_node: Optional[int] = None,
    ) -> "GPUSpec":
        """This GPU in another node. Host memory given per node is taken as is, per GPU times the
        GPUs per node; given neither, each GPU keeps the preset's share (a 16-GPU V100 node then
        has twice the 8-GPU node's memory, as a DGX-2 has)."""
        if host_memory_per_gpu is not None and host_memory_per_node is not None:
            raise ValueError("give the host memory per GPU or per node, not both")
        gpus = gpus_per_node or self.gpus_per_node
        if host_memory_per_node is None:
            per_gpu = host_memory_per_gpu or self.host_memory_per_node // self.gpus_per_node
            host_memory_per_node = per_gpu * gpus
        return dataclasses.replace(self, gpus_per_node=gpus, host_memory_per_node=host_memory_per_node)


# Host memory per node, from NVIDIA's DGX datasheets (DIMM capacities, so binary units):
# V100: a DGX-1 has 512 GiB for 8 GPUs, a DGX-2 1.5 TiB for 16; the preset takes the DGX-2's
# share, 96 GiB per GPU = 768 GiB per 8 (between the two: a mid-range 8 x V100-32GB server).
# A100: a DGX A100 with 40 GB GPUs has 1 TiB, the 80 GB model 2 TiB; the preset takes the lower
# figure, which most 8 x A100 servers reach. H100 and H200: DGX H100 and DGX H200 have 2 TiB.
GPU_PRESETS: Dict[str, GPUSpec] = {
    # DGX-1V: NVLink2 6 x 25 GB/s, 4 x 100 Gb/s IB per 8 GPUs, PCIe gen3 x16.
    "V100-32GB": GPUSpec(
        "V100-32GB",
        32510 * 2**20,
        125e12,
        15.7e12,
        900e9,
        150e9,
        6.25e9,
        12e9,
        host_memory_per_node=768 * GiB,
        bf16=False,
    ),
    # DGX A100: NVLink3 300 GB/s, 8 x 200 Gb/s HDR, PCIe gen4.
    "A100-80GB": GPUSpec(
        "A100-80GB", 81920 * 2**20, 312e12, 19.5e12, 2039e9, 300e9, 25e9, 25e9, host_memory_per_node=TiB
    ),
    # DGX H100: NVLink4 450 GB/s, 8 x 400 Gb/s NDR, PCIe gen5.
    "H100-80GB": GPUSpec(
        "H100-80GB", 81559 * 2**20, 989e12, 67e12, 3350e9, 450e9, 50e9, 50e9, host_memory_per_node=2 * TiB
    ),
    "H200-141GB": GPUSpec(
        "H200-141GB", 143771 * 2**20, 989e12, 67e12, 4800e9, 450e9, 50e9, 50e9, host_memory_per_node=2 * TiB
    ),
    # H800 SXM (NVIDIA's H800 datasheet: H100 SXM's compute, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s
    # where H100's is 900, both counted in both directions: 200 GB/s each way, as H100's 450). The
    # network is DeepSeek-V3's cluster (arXiv 2412.19437, sections 3.1 and 3.2.2: 8 GPUs per node,
    # InfiniBand at 50 GB/s per GPU; it quotes 160 GB/s as NVLink's achievable rate). Host memory
    # is not published: assumed a DGX H100's 2 TiB, as its CPUs (GPU_HOSTS) and disks (NVME_PRESETS).
    "H800-80GB": GPUSpec(
        "H800-80GB", 81559 * 2**20, 989e12, 67e12, 3350e9, 200e9, 50e9, 50e9, host_memory_per_node=2 * TiB
    ),
}


@dataclass(frozen=True)
class NvmeSpec:
    """A node's local NVMe: ``per_node`` bytes shared by its GPUs, and ``bw``: the bytes/s of disk
    traffic (reads and writes together) each GPU gets: the node's drives over its GPUs."""

    per_node: int
    bw: float

    def replace(self, **changes) -> "NvmeSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# Local NVMe per node, from NVIDIA's DGX datasheets (capacities in decimal TB, as drives are sold),
# and the bandwidth per GPU of the drives' class: a PCIe gen3 x4 U.2 drive streams ~3 GB/s read and
# ~2 GB/s write, a gen4 one ~6.5 and ~3.5 GB/s; a step reads and writes alike, so a drive's mixed
# figure is taken as the mean (2.5 and 5 GB/s). Not measured on these machines: give yours.
# V100: the preset's node is half a DGX-2 (as its host memory): 4 of the DGX-2's 8 x 3.84 TB gen3
# drives, 15.36 TB, 4 x 2.5 / 8 = 1.25 GB/s per GPU. (A DGX-1 has 4 x 1.92 TB SATA SSDs, ~0.5 GB/s
# each: --nvme-per-node 7.68TB --nvme-bw 0.25e9.) A100: a DGX A100 (the 320 GB model, as the
# preset's host memory) has 4 x 3.84 TB gen4, 15.36 TB, 4 x 5 / 8 = 2.5 GB/s per GPU. H100 and H200:
# DGX H100 and DGX H200 have 8 x 3.84 TB gen4, 30.72 TB, 8 x 5 / 8 = 5 GB/s per GPU.
NVME_PRESETS: Dict[str, NvmeSpec] = {
    "V100-32GB": NvmeSpec(per_node=4 * 3840 * 10**9, bw=1.25e9),
    "A100-80GB": NvmeSpec(per_node=4 * 3840 * 10**9, bw=2.5e9),
    "H100-80GB": NvmeSpec(per_node=8 * 3840 * 10**9, bw=5e9),
    "H200-141GB": NvmeSpec(per_node=8 * 3840 * 10**9, bw=5e9),
    "H800-80GB": NvmeSpec(per_node=8 * 3840 * 10**9, bw=5e9),  # assumed: a DGX H100's
}


@dataclass(frozen=True)
class HostSpec:
    """A node's CPUs as the host optimizer step sees them: ``cores`` (physical, all sockets),
    ``dram_bw`` (sustained bytes/s of the node's DRAM: ``dram_peak`` x the assumed sustained
    fraction, or measured) and ``thread_bw`` (bytes/s one thread's optimizer kernel streams;
    ``setting_bw``: measured per kernel setting, ``planning.host_step.Setting``, where known).
    ``sources``: for each figure, where it comes from ("sourced: ...", "assumed: ...",
    "measured: ..."), printed beside the plan."""

    name: str
    cores: int
    dram_bw: float
    thread_bw: float
    dram_peak: Optional[float] = None
    sources: Dict[str, str] = dataclasses.field(default_factory=dict)
    setting_bw: Dict[tuple, float] = dataclasses.field(default_factory=dict)  # measured per kernel setting


SUSTAINED_FRACTION = 0.65  # assumed: STREAM triad on 2-socket Xeon/EPYC servers reaches ~60-75% of peak


def _channels(sockets: int, channels: int, mt_per_s: int) -> float:
    """Theoretical DRAM peak: sockets x channels x MT/s x 8 B."""
    return sockets * channels * mt_per_s * 1e6 * 8


def _node(
    name: str, cpu: str, cores: int, sockets: int, channels: int, mt_per_s: int, thread_bw: float, thread_why: str
) -> HostSpec:
    peak = _channels(sockets, channels, mt_per_s)
    return HostSpec(
        name,
        cores,
        peak * SUSTAINED_FRACTION,
        thread_bw,
        peak,
        {
            "cores": f"sourced: {cpu} (NVIDIA {name} datasheet; vendor CPU specifications)",
            "dram_bw": f"assumed: {SUSTAINED_FRACTION:.0%} sustained (STREAM-class triad) of the sourced peak, {sockets} "
            f"sockets x {channels} DDR channels x {mt_per_s} MT/s x 8 B = {peak / 1e9:.1f} GB/s",
            "thread_bw": f"assumed: {thread_bw / 1e9:.0f} GB/s per thread, {thread_why}; not measured on this node",
        },
    )


# The CPUs of the nodes the GPU presets stand for (NVIDIA DGX datasheets; Intel ARK / AMD product
# pages for the memory channels and speeds). One thread's kernel is assumed to stream about what
# one core's STREAM triad reaches on that class of CPU (the host kernels run at the memory bound,
# benchmarks/host_optimizer.py): measure yours with --host-calibration.
HOST_PRESETS: Dict[str, HostSpec] = {
    "DGX-1V": _node(
        "DGX-1V",
        "2 x Xeon E5-2698 v4 (Broadwell, 20 cores each)",
        40,
        2,
        4,
        2400,
        10e9,
        "a Broadwell core's single-thread triad",
    ),
    "DGX-2": _node(
        "DGX-2",
        "2 x Xeon Platinum 8168 (Skylake-SP, 24 cores each)",
        48,
        2,
        6,
        2666,
        11e9,
        "a Skylake-SP core's single-thread triad",
    ),
    "DGX-A100": _node(
        "DGX-A100",
        "2 x AMD EPYC 7742 (Rome, 64 cores each)",
        128,
        2,
        8,
        3200,
        20e9,
        "a Rome core's single-thread triad",
    ),
    "DGX-H100": _node(
        "DGX-H100",
        "2 x Xeon Platinum 8480C (Sapphire Rapids, 56 cores each)",
        112,
        2,
        8,
        4800,
        12e9,
        "a Sapphire Rapids core's single-thread triad",
    ),
    "DGX-H200": _node(
        "DGX-H200",
        "2 x Xeon Platinum 8480C (Sapphire Rapids, 56 cores each)",
        112,
        2,
        8,
        4800,
        12e9,
        "a Sapphire Rapids core's single-thread triad",
    ),
}
# The node each GPU preset's host figures come from (V100-32GB: the DGX-1V's CPUs, whatever its
# host memory; a DGX-2-class V100 node is --host-node DGX-2 --gpus-per-node 16).
GPU_HOSTS: Dict[str, str] = {
    "V100-32GB": "DGX-1V",
    "A100-80GB": "DGX-A100",
    "H100-80GB": "DGX-H100",
    "H200-141GB": "DGX-H200",
    "H800-80GB": "DGX-H100",  # assumed: DeepSeek's nodes' CPUs are not published
}
