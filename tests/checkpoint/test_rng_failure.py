"""Issue 38 bug 9: with rank 1's RNG file corrupt and 2 ranks loading, rank 1 named the file but
rank 0, already training, reported only that a peer rank died. Now every rank raises the failing
rank's error, so the first error a user reads (rank 0's) names the file."""

import json
import os
import struct

from tests.harness import run_distributed
from tests.checkpoint.common import cfg_of


def _flip_cpu_rng_bit(path: str) -> None:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        start, end = json.loads(fh.read(n))["cpu_rng_state"]["data_offsets"]
    with open(path, "r+b") as fh:
        fh.seek(8 + n + (start + end) // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0x10]))


def _save_then_load_with_rank1s_rng_corrupt(rank, world, root):
    import torch.distributed as dist
    from megatron_p2r.checkpoint.errors import CheckpointError
    from megatron_p2r.training import pretrain

    ck = os.path.join(root, "ck")
    pretrain(cfg_of(save=ck, train_iters=2, global_batch_size=8))
    dist.barrier()
    if rank == 0:
        _flip_cpu_rng_bit(os.path.join(ck, "iter_0000002", "rng_and_data", "rank_00001.safetensors"))
    dist.barrier()
    try:
        pretrain(cfg_of(load=ck, train_iters=3, global_batch_size=8))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_every_rank_names_the_corrupt_rng_file_of_rank_1(tmp_path):
    errors = run_distributed(_save_then_load_with_rank1s_rng_corrupt, 2, str(tmp_path))
    assert errors[0] is not None and errors[0].startswith("rank 1: corrupt shard "), errors
    assert "rng_and_data/rank_00001.safetensors: tensor 'cpu_rng_state' has CRC-32" in errors[0]
    assert errors[1] is not None and errors[1].startswith("corrupt shard ") and "rank_00001" in errors[1], errors
