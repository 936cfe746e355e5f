"""Pretrain an M6 language model: ``torchrun --nproc-per-node N pretrain_m6.py [flags]``.

Flags are Megatron-style (``--help`` lists them); ``--config FILE.yaml`` takes the same names.
"""
from __future__ import annotations

import sys

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        from megatron_p2r.training import pretrain
        pretrain(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
