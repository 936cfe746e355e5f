"""Pretrain an M6 language model: ``torchrun --nproc-per-node N pretrain_m6.py [flags]``.

Flags are Megatron-style (``--help`` lists them); ``--config FILE.yaml`` takes the same names.
Megatron-LM's launch scripts run unchanged (docs/megatron.md): a Megatron-LM flag that only picks
a kernel or an integration we do not have is reported once, on rank 0, as "no effect here: ...".
Exit status: 0 done, 2 bad input (flags, config, data, tokenizer or checkpoint: the message
names which), 1 the run failed (stopped on non-finite values, a collective failed or timed
out, an OS error such as a full disk); the message is one ``error:`` line on stderr.
"""

from __future__ import annotations

import os
import sys

from megatron_p2r.arguments import parse_launch


def main(argv=None) -> int:
    from megatron_p2r.cli import BAD_INPUT, INPUT_ERRORS, RUN_FAILED, fail
    from megatron_p2r.reliability import describe_distributed_failure
    from megatron_p2r.training import TrainingStopped

    rank = os.environ.get("RANK", "0")
    cfg = None
    try:
        cfg, no_effect = parse_launch(argv)
        if no_effect and rank == "0":
            print("no effect here: " + "; ".join(no_effect), flush=True)
        from megatron_p2r.training import pretrain

        pretrain(cfg)
    except INPUT_ERRORS as exc:
        return fail(str(exc), BAD_INPUT)
    except TrainingStopped as exc:
        return fail(f"rank {rank}: training stopped: {exc}", RUN_FAILED)
    except OSError as exc:
        return fail(f"rank {rank}: {exc}", RUN_FAILED)
    except RuntimeError as exc:
        message = describe_distributed_failure(exc, cfg.parallel.distributed_timeout_minutes if cfg else None)
        if message is None:
            raise
        return fail(f"rank {rank}: {message}", RUN_FAILED)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
