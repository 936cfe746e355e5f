"""A checkpoint of ours, in any layout and either phase, read as the global pieces of the real
model: what export and the reference model for verification both read."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_p2r.checkpoint.compatibility import check_tables
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.expert_bias import FIELD as EXPERT_BIAS
from megatron_p2r.checkpoint.integrity import check_files
from megatron_p2r.checkpoint.metadata import broadcast_statistics, metadata_config, metadata_table, read_metadata
from megatron_p2r.checkpoint.naming import METADATA_FILE, resolve_iteration_dir
from megatron_p2r.convert.pieces import read_global
from megatron_p2r.convert.reshard import Target, target_config
from megatron_p2r.checkpoint.tensor_table import ShardLayout, tensor_table
from megatron_p2r.config import Config
from megatron_p2r.p2r import delink as dl


def _single_real_config(cfg: Config) -> Config:
    """The same model, real phase, on one process (its table lists every real piece in model order)."""
    return target_config(cfg, Target(1, 1, None, 1), delink=cfg.p2r.p2r_phase == "pseudo")


class SourceCheckpoint:
    """Global real-model pieces of a checkpoint of ours in any layout; a pseudo one is delinked
    on the fly (real layer i reads the module its pseudo layer called)."""

    def __init__(self, path: str):
        self.iter_dir = resolve_iteration_dir(path)
        self.meta = read_metadata(self.iter_dir)
        self.readers = check_files(self.iter_dir, self.meta)
        self.cfg = metadata_config(self.meta)
        self.table = metadata_table(self.meta)
        # names, shapes and QKV row layouts as this code lays the checkpoint's model out
        check_tables(self.table, tensor_table(self.cfg), os.path.join(self.iter_dir, METADATA_FILE))
        self.layout = ShardLayout.of(self.cfg)
        self.pseudo = self.meta["p2r"]["phase"] == "pseudo"
        self.layer_keys = self.meta["p2r"]["layer_module_keys"]
        self.real_cfg = _single_real_config(self.cfg)

    def read(self, key: str, kind: str = "model") -> torch.Tensor:
        """Piece ``key``'s fp32 weight, or its optimizer state ``kind`` (a moment, the step)."""
        skey = dl.source_key(key, self.layer_keys) if self.pseudo else key
        info = self.table.get(skey)
        if info is None:
            raise CheckpointError(f"{os.path.join(self.iter_dir, METADATA_FILE)}: tensors has no {skey!r}")
        return read_global(self.readers, self.layout, info, kind, broadcast_statistics(self.meta))

    def expert_bias(self, name: str) -> Optional[torch.Tensor]:
        """The real model's router bias ``name`` (``checkpoint/expert_bias.py``), fp32; None when the
        checkpoint holds none (a run without --moe-router-enable-expert-bias: no bias is a zero one)."""
        values = (self.meta.get(EXPERT_BIAS) or {}).get(dl.source_key(name, self.layer_keys) if self.pseudo else name)
        return None if values is None else torch.tensor(values, dtype=torch.float32)
