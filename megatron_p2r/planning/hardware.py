"""The accelerators the planner knows: memory, peak FLOP/s and link bandwidths of each preset."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict

GiB = 2 ** 30


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and its links. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    memory: int              # bytes usable by the process (as nvidia-smi reports the total)
    flops16: float           # dense bf16/fp16 tensor-core FLOP/s
    flops32: float           # dense fp32 FLOP/s (TF32 off)
    hbm_bw: float            # device memory bandwidth (the optimizer step is bound by it)
    intra_node_bw: float     # NVLink, per GPU
    inter_node_bw: float     # network, per GPU (node NIC bandwidth / GPUs per node)
    host_bw: float           # PCIe host <-> device, per GPU
    gpus_per_node: int = 8
    bf16: bool = True        # V100 has fp16 tensor cores but no bf16

    def replace(self, **changes) -> "GPUSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


GPU_PRESETS: Dict[str, GPUSpec] = {
    # DGX-1V: NVLink2 6 x 25 GB/s, 4 x 100 Gb/s IB per 8 GPUs, PCIe gen3 x16.
    "V100-32GB": GPUSpec("V100-32GB", 32510 * 2**20, 125e12, 15.7e12, 900e9, 150e9, 6.25e9, 12e9, bf16=False),
    # DGX A100: NVLink3 300 GB/s, 8 x 200 Gb/s HDR, PCIe gen4.
    "A100-80GB": GPUSpec("A100-80GB", 81920 * 2**20, 312e12, 19.5e12, 2039e9, 300e9, 25e9, 25e9),
    # DGX H100: NVLink4 450 GB/s, 8 x 400 Gb/s NDR, PCIe gen5.
    "H100-80GB": GPUSpec("H100-80GB", 81559 * 2**20, 989e12, 67e12, 3350e9, 450e9, 50e9, 50e9),
    "H200-141GB": GPUSpec("H200-141GB", 143771 * 2**20, 989e12, 67e12, 4800e9, 450e9, 50e9, 50e9),
}
