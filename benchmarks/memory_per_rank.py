"""Bytes per rank of weights, gradients and optimizer state: measured on 4 CPU ranks against the
planner, and the planner against Megatron-LM's own formula on its published configurations.

    python benchmarks/memory_per_rank.py [--hidden 512] [--steps 6]      # 4 gloo ranks
    python benchmarks/memory_per_rank.py --tables                        # Megatron's tables, on paper

Ranks: one model on 4 CPU ranks as DP4 and TP2 x DP2, in fp32 and with 16-bit weights (bf16),
each with and without the distributed optimizer: per rank the bytes of weights, gradient buffers
and optimizer state, measured by tensor accounting (``training.describe_memory``) after a step,
next to the planner's exact figure (``planning.memory.stage_state_bytes``); then the step time of
bf16 + distributed optimizer with --overlap-grad-reduce --overlap-param-gather on and off,
alternating steps in the same processes (gloo: the collectives run on gloo's threads).

Tables: the configurations of Narayanan et al. 2021 (Table 1, A100-80GB: vocab 51200, seq 2048)
and of Megatron-LM's README (H100-80GB weak scaling: vocab 131072, seq 4096, DP 48), micro-batch
1, bf16, each with the activation memory its authors used: Narayanan et al. recompute every layer
in full; the README's runs overlap TP communication (``--tp-comm-overlap``, which Megatron-LM
allows only with ``--sequence-parallel``) and are planned with Korthikanti et al.'s recipe,
sequence parallelism and selective recomputation (the README does not name its recomputation).
Per GPU the planner's model + optimizer bytes (most loaded stage,
with and without --use-distributed-optimizer) against Megatron-LM's
``compute_weight_and_optimizer_memory`` (megatron/training/theoretical_memory_usage.py: 18 B per
parameter, 6 + 12/DP with its distributed optimizer, on its count of the most loaded shard),
and whether the whole rank fits. The models are the ones that formula counts: LayerNorm, GELU
(ffn 4h), tied embeddings, no biases and no learned position embeddings (RoPE) — the formula
leaves those out, so with GPT-3's learned positions and biases (``--gpt3``) every model of both
Megatron-LM and ours holds 0.3-2% more than it says.
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

GiB = 2**30
LAYOUTS = {"DP4": {}, "TP2xDP2": {"tensor_model_parallel_size": 2}}
VARIANTS = {
    "fp32": {},
    "fp32+distopt": {"use_distributed_optimizer": True},
    "bf16": {"bf16": True},
    "bf16+distopt": {"bf16": True, "use_distributed_optimizer": True},
}


def _config(hidden: int, **flags):
    return config_from_values(
        dict(
            num_layers=4,
            hidden_size=hidden,
            num_attention_heads=8,
            seq_length=128,
            vocab_size=4096,
            micro_batch_size=2,
            global_batch_size=16,
            mock_data=True,
            train_iters=1000,
            **flags,
        )
    )


def _rank(rank, world, hidden, steps):
    from megatron_p2r.planning.memory import stage_state_bytes
    from megatron_p2r.training import (
        build_datasets,
        build_train_state,
        describe_memory,
        microbatch_iterator,
        setup_parallel,
        train_step,
    )

    torch.set_num_threads(1)
    out = {"memory": {}, "times": {"overlap": [], "no overlap": []}}
    for layout, lflags in LAYOUTS.items():
        for variant, vflags in VARIANTS.items():
            cfg = _config(hidden, **lflags, **vflags)
            ps, plan = setup_parallel(cfg, torch.device("cpu"))
            state = build_train_state(cfg, ps, plan)
            data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
            train_step(state, [next(data) for _ in range(num_microbatches(cfg, world))])  # moments exist
            out["memory"][(layout, variant)] = (describe_memory(state), stage_state_bytes(plan, ps.pp_rank, ps.coords))
    runs = {}
    for label, overlap in (("overlap", True), ("no overlap", False)):
        cfg = _config(
            hidden,
            bf16=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
            ddp_bucket_size=hidden * hidden * 4,
        )
        ps, plan = setup_parallel(cfg, torch.device("cpu"))
        data = microbatch_iterator(build_datasets(cfg, ps)[0], 0, cfg, ps)
        runs[label] = (cfg, build_train_state(cfg, ps, plan), data)
    for step in range(steps + 1):  # alternate so machine noise hits both alike; the first is warm-up
        for label, (cfg, state, data) in runs.items():
            batch = [next(data) for _ in range(num_microbatches(cfg, world))]
            start = time.perf_counter()
            train_step(state, batch)
            state.ddp.finish_param_sync()
            if step:
                out["times"][label].append(time.perf_counter() - start)
    return out


def ranks_mode(hidden: int, steps: int) -> None:
    results = run_distributed(_rank, 4, hidden, steps, timeout=1800)
    n = results[0]["memory"][("DP4", "fp32")][0]["parameters"]
    print(
        f"4 layers, hidden {hidden}, on 4 gloo ranks; bytes per rank after one step, measured (tensor "
        f"accounting) / planner; B/param = (weights + grads + optimizer) / the rank's parameters\n"
    )
    print(
        f"{'layout':>8} {'variant':>13} {'rank':>4} {'params':>10} | {'weights MiB':>17} {'grads MiB':>17} "
        f"{'optimizer MiB':>17} | {'B/param':>7}"
    )
    for layout, variant in results[0]["memory"]:
        for rank, r in enumerate(results):
            got, want = r["memory"][(layout, variant)]
            cells = [
                f"{got[k] / 2**20:8.3f}/{want[c] / 2**20:8.3f}"
                for k, c in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer"))
            ]
            per = (got["param_bytes"] + got["grad_bytes"] + got["optimizer_bytes"]) / got["parameters"]
            same = (
                ""
                if (got["param_bytes"], got["grad_bytes"], got["optimizer_bytes"])
                == (want["params"], want["grads"], want["optimizer"])
                else "  <-- differs"
            )
            print(
                f"{layout:>8} {variant:>13} {rank:>4} {got['parameters']:>10,} | {' '.join(cells)} | {per:7.2f}{same}"
            )
    print(f"\n(the model has {n:,} parameters per DP4 rank)")
    on = statistics.median(t for r in results for t in r["times"]["overlap"])
    off = statistics.median(t for r in results for t in r["times"]["no overlap"])
    print(
        f"bf16 + distributed optimizer, DP4, {steps} steps: median step {1000 * on:.0f} ms with "
        f"--overlap-grad-reduce --overlap-param-gather, {1000 * off:.0f} ms without: ratio {on / off:.2f}"
    )


# ----------------------------------------------------------------------------- Megatron's tables

# (name, heads, hidden, layers, TP, PP, GPUs, global batch)
NARAYANAN_2021 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072),
]
MEGATRON_README_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192),
    ("16B", 48, 6144, 32, 4, 1, 192, 192),
    ("32B", 56, 7168, 48, 8, 1, 384, 192),
    ("70B", 64, 8192, 84, 8, 2, 768, 384),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072),
]
FULL_RECOMPUTATION = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE_AND_SP = dict(recompute_activations=True, sequence_parallel=True)
# title: (rows, vocab, seq, GPU, activation flags, as the header says them)
TABLES = {
    "Narayanan et al. 2021, Table 1 (A100-80GB)": (
        NARAYANAN_2021,
        51200,
        2048,
        "A100-80GB",
        FULL_RECOMPUTATION,
        "full recomputation",
    ),
    "Megatron-LM README, weak scaling (H100-80GB)": (
        MEGATRON_README_H100,
        131072,
        4096,
        "H100-80GB",
        SELECTIVE_AND_SP,
        "sequence parallelism + selective recomputation",
    ),
}


def megatron_weight_and_optimizer_bytes(
    h: int, layers: int, vocab: int, tp: int, pp: int, dp: int, distributed: bool
) -> float:
    """Megatron-LM's estimate for a dense GPT with LayerNorm, GELU (ffn 4h), tied embeddings:
    its count of the most loaded shard (1/PP of the layers' attention + MLP weights and the
    embedding, over TP; 1/PP of the norms) times 18 B, or 6 + 12/DP B with its distributed
    optimizer (bf16 weights, fp32 gradients, fp32 mains and Adam moments). Biases and learned
    position embeddings are not in its count."""
    per_layer_sharded = 4 * h * h + 2 * h * 4 * h  # attention (Q, K, V, out) + MLP
    norms = 2 * h * 2 * layers + 2 * h  # two LayerNorms per layer + the final one
    shard = (per_layer_sharded * layers / pp + h * vocab) / tp + norms / pp
    return shard * ((6 + 12 / dp) if distributed else 18)


def _gpt(name, heads, hidden, layers, tp, pp, gpus, gbs, vocab, seq, activations, distributed, gpt3):
    style = {} if gpt3 else dict(position_embedding_type="rope", disable_bias_linear=True)
    return config_from_values(
        dict(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            **style,
            seq_length=seq,
            vocab_size=vocab,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            micro_batch_size=1,
            global_batch_size=gbs,
            bf16=True,
            **activations,
            mock_data=True,
            use_distributed_optimizer=distributed,
            overlap_grad_reduce=distributed,
            overlap_param_gather=distributed,
        )
    )


def tables_mode(gpt3: bool) -> None:
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.planning.estimate import make_plan
    from megatron_p2r.planning.hardware import GPU_PRESETS
    from megatron_p2r.planning.memory import stage_state_bytes

    for title, (rows, vocab, seq, gpu_name, activations, activations_said) in TABLES.items():
        gpu = GPU_PRESETS[gpu_name]
        print(
            f"== {title}: vocab {vocab}, seq {seq}, micro-batch 1, bf16, {activations_said}\n"
            f"   GiB per GPU of weights + gradients + optimizer (most loaded stage); total = the planner's "
            f"whole rank (+ activations, 1 GiB reserve) of {gpu.memory / GiB:.0f}"
        )
        print(
            f"   {'model':>6} {'TPxPPxDP':>10} | {'Megatron 18B':>12} {'ours':>7} {'ratio':>6} | "
            f"{'Megatron 6+12/DP':>16} {'ours':>7} {'ratio':>6} | {'total ours+distopt':>18} fits"
        )
        for row in rows:
            name, heads, hidden, layers, tp, pp, gpus, gbs = row
            dp = gpus // (tp * pp)
            figures = []
            for distributed in (False, True):
                cfg = _gpt(*row, vocab, seq, activations, distributed, gpt3)
                plan = ParallelPlan.for_world(cfg, gpus)
                ours = max(
                    sum(stage_state_bytes(plan, s)[c] for c in ("params", "grads", "optimizer")) for s in range(pp)
                )
                meg = megatron_weight_and_optimizer_bytes(hidden, layers, vocab, tp, pp, dp, distributed)
                figures.append((meg, ours, cfg))
            (m18, o18, _), (mdo, odo, cfg) = figures
            est = make_plan(cfg, gpus, gpu)  # the whole rank, as run: with the distributed optimizer
            total = max(st.device_total for st in est.stages)
            print(
                f"   {name:>6} {f'{tp}x{pp}x{dp}':>10} | {m18 / GiB:12.2f} {o18 / GiB:7.2f} {o18 / m18:6.4f} | "
                f"{mdo / GiB:16.2f} {odo / GiB:7.2f} {odo / mdo:6.4f} | {total / GiB:18.2f} "
                f"{'yes' if est.fits else 'NO'}"
            )
        print()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", action="store_true", help="Megatron-LM's published configurations, on paper.")
    p.add_argument("--gpt3", action="store_true", help="Tables: GPT-3's learned positions and biases.")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    if args.tables:
        tables_mode(args.gpt3)
    else:
        ranks_mode(args.hidden, args.steps)


if __name__ == "__main__":
    main()
