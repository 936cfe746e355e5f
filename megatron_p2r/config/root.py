"""``Config``: the nine sections together, frozen once built (the batch arithmetic is ``batch.py``).

A config is never changed in place: ``cfg.replace(vocab_size=..., p2r_phase=...)`` returns a
new one, so a value checked by ``validate`` is the value every module reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_p2r.config.checkpoint import CheckpointConfig
from megatron_p2r.config.data import DataConfig
from megatron_p2r.config.fields import ConfigError
from megatron_p2r.config.logging import LoggingConfig
from megatron_p2r.config.model import ModelConfig
from megatron_p2r.config.offload import OffloadConfig
from megatron_p2r.config.p2r import P2RConfig
from megatron_p2r.config.profiling import ProfilingConfig
from megatron_p2r.config.parallel import ParallelConfig
from megatron_p2r.config.train import TrainConfig


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    p2r: P2RConfig = field(default_factory=P2RConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{f.name: f.default_factory(**d.get(f.name, {})) for f in dataclasses.fields(cls)})

    def replace(self, **values) -> "Config":
        """A copy with the given fields changed, named flat as on the command line."""
        changes = {}
        for name, value in values.items():
            if name not in _SECTION_OF_FIELD:
                raise ConfigError(f"unknown config field {name!r}")
            changes.setdefault(_SECTION_OF_FIELD[name], {})[name] = value
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **kw) for section, kw in changes.items()}
        )


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
_SECTION_OF_FIELD = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
