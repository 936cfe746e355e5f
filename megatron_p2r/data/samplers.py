"""Which global sample indices each data-parallel rank reads, micro-batch by micro-batch.

Megatron-LM's MegatronPretrainingSampler: the samples are consumed in order, ``mb * DP`` per
step, rank r taking ``[r*mb, (r+1)*mb)`` of each step. Position is just ``consumed_samples``,
so a run resumed from a checkpoint continues with exactly the samples it would have seen.
"""

from __future__ import annotations

from typing import Iterator, List


class PretrainingSampler:
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: total_samples = {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must lie in [0, total_samples {total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) must be positive"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} must lie in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        """A last step short of mb*DP samples is dropped, or with drop_last=False yields this rank's part of it."""
        first = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.step):
            end = min(start + self.step, self.total_samples)
            if end - start < self.step and self.drop_last:
                return
            yield list(range(start + first, min(start + first + self.micro_batch_size, end)))
