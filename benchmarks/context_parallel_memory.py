"""Activation bytes a context-parallel rank keeps for backward, against one process at the same
sequence: what CP buys in memory, measured by tensor accounting.

    python benchmarks/context_parallel_memory.py [--seq 1024] [--hidden 256] [--heads 8] [--layers 2]

For CP 1, 2 and 4 (gloo ranks on this host) and each --cp-comm-type, one micro-batch's forward
with the loss runs under ``saved_tensors_hooks``; the bytes of the distinct storages autograd
keeps (weights excluded) are summed on each rank. Printed: the largest rank's bytes and their
ratio to CP 1 (1/CP would be a perfect split: what stays above it is what attention keeps of the
other ranks' keys and values, and the embedding/loss tensors of the whole vocabulary).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.harness: local gloo ranks

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402
from tests.helpers import random_microbatches, tiny_config  # noqa: E402


def _config(args, cp: int, comm_type: str):
    return tiny_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        micro_batch_size=1,
        position_embedding_type="rope",
        context_parallel_size=cp,
        cp_comm_type=comm_type,
        num_experts=None,
    )


def _saved_bytes(rank, world, args, comm_type):
    from megatron_p2r.context.chunks import split_batch
    from megatron_p2r.model.m6 import build_model
    from megatron_p2r.training import setup_parallel

    cfg = _config(args, world, comm_type)
    ps, plan = setup_parallel(cfg, torch.device("cpu"))
    model = build_model(cfg, ps, plan)
    mb = split_batch(random_microbatches(cfg, 1, 1)[0], ps.cp_size, ps.cp_rank)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages, alive = {}, []

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        alive.append(t)  # a freed storage's address must not be reused while counting
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"])
    return sum(n for ptr, n in storages.items() if ptr not in params)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"activations kept for backward, one micro-batch of 1 x {args.seq} tokens, hidden {args.hidden}")
    print("| CP | --cp-comm-type | bytes (largest rank) | / CP 1 |")
    print("|---|---|---|---|")
    one = max(run_distributed(_saved_bytes, 1, args, "p2p"))
    print(f"| 1 | - | {one:,} | 1.00 |")
    for cp in (2, 4):
        for comm_type in ("p2p", "allgather", "a2a"):
            if comm_type == "a2a" and args.heads % cp:
                continue
            most = max(run_distributed(_saved_bytes, cp, args, comm_type, timeout=1800))
            print(f"| {cp} | {comm_type} | {most:,} | {most / one:.2f} |")


if __name__ == "__main__":
    main()
