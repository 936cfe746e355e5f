"""Pseudo vs real: per-rank parameter + optimizer bytes and step time, side by side.

    python benchmarks/pseudo_memory.py [--layers 8] [--steps 5]

Shape: 8 layers with MoE in every other layer, PP=2 on 2 CPU processes, share-pattern all.
Per stage the real model holds 4 layers (2 dense, 2 MoE); the pseudo model one dense and one
MoE module, so the layer bytes must shrink by exactly the theoretical factor
(dense + MoE bytes of the stage's layers) / (one dense + one MoE layer). The step times are
measured alternately in the same processes; the pseudo step does the same compute plus one
extra all-reduce of the shared slot's gradient over the two stages.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.config import num_microbatches  # noqa: E402
from tests.harness import run_distributed  # noqa: E402
from megatron_p2r.training import (
    build_datasets,
    build_train_state,
    describe_memory,  # noqa: E402
    microbatch_iterator,
    setup_parallel,
    train_step,
)


def _config(phase: str, layers: int):
    return config_from_values(
        dict(
            num_layers=layers,
            hidden_size=128,
            num_attention_heads=4,
            seq_length=64,
            vocab_size=1000,
            num_experts=4,
            moe_layer_freq=[0, 1] * (layers // 2),  # the odd layers MoE, as the figures were taken
            moe_router_topk=2,
            moe_router_pre_softmax=True,
            moe_ffn_hidden_size=256,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pipeline_model_parallel_size=2,
            micro_batch_size=4,
            global_batch_size=16,
            mock_data=True,
            train_iters=100,
            p2r_phase=phase,
            share_pattern="all",
        )
    )


def _layer_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))


def _rank(rank, world, layers, steps):
    torch.set_num_threads(1)
    out = {}
    states = {}
    for phase in ("real", "pseudo"):
        cfg = _config(phase, layers)
        ps, _ = setup_parallel(cfg, torch.device("cpu"))
        state = build_train_state(cfg, ps)
        data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
        n = num_microbatches(cfg, ps.layout.world_size)
        train_step(state, [next(data) for _ in range(n)])  # warm-up, creates optimizer state
        mem = describe_memory(state)
        optim_bytes = mem["optimizer_bytes"]
        states[phase] = (state, data, n)
        out[phase] = {
            "params": mem["parameters"],
            "param_bytes": mem["param_bytes"],
            "optimizer_bytes": optim_bytes,
            "layer_bytes": _layer_bytes(state.model),
            "modules": len(state.model.layers),
            "layers": len(state.model.layer_keys),
            "times": [],
        }
    for _ in range(steps):  # alternate so machine noise hits both alike
        for phase, (state, data, n) in states.items():
            start = time.perf_counter()
            train_step(state, [next(data) for _ in range(n)])
            out[phase]["times"].append(time.perf_counter() - start)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    results = run_distributed(_rank, 2, args.layers, args.steps, timeout=900)
    print(f"{args.layers} layers, MoE every other layer, PP=2, share-pattern all; {args.steps} timed steps\n")
    print(
        f"{'stage':>5} {'phase':>6} {'modules/layers':>14} {'params':>10} {'param+optim MiB':>16} "
        f"{'layer MiB':>10} {'step ms (median)':>17}"
    )
    for stage, r in enumerate(results):
        for phase in ("real", "pseudo"):
            x = r[phase]
            total = (x["param_bytes"] + x["optimizer_bytes"]) / 2**20
            print(
                f"{stage:>5} {phase:>6} {x['modules']:>6}/{x['layers']:<7} {x['params']:>10,} {total:>16.2f} "
                f"{x['layer_bytes'] / 2**20:>10.2f} {1000 * statistics.median(x['times']):>17.1f}"
            )
        measured = r["real"]["layer_bytes"] / r["pseudo"]["layer_bytes"]
        theory = r["real"]["modules"] / r["pseudo"]["modules"]  # each kind's modules have equal size
        ratio = statistics.median(r["pseudo"]["times"]) / statistics.median(r["real"]["times"])
        print(
            f"      stage {stage}: layer-byte ratio real/pseudo {measured:.3f} (theory {theory:.3f}); "
            f"step time pseudo/real {ratio:.2f}\n"
        )


if __name__ == "__main__":
    main()
