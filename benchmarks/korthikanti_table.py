"""Activation bytes per transformer layer: the planner against Korthikanti et al. 2022, Table 2.

    python benchmarks/korthikanti_table.py [--micro-batch 1]

For the paper's 22B / 175B / 530B / 1T shapes (Table 3: heads, hidden size; sequence 2048,
TP 8) with bf16, LayerNorm, GELU, biases and dropout on, the planner's per-layer activations
(``planning.activations.layer_activations``, CUDA variant) next to the paper's formulas, for
no parallelism, TP, TP + sequence parallelism, TP + selective recomputation and all three.
Prints a markdown table (docs/scale.md) and the difference the planner explains term by term:
the norms' fp32 statistics, the fused attention's log-sum-exp, and no s x s tensors (-5as^2b/t).
(With --bf16 the model holds 16-bit weights and computes without autocast, so the residual
stream and the norms' inputs are 16-bit, as in the paper.)
"""
from __future__ import annotations

import argparse

from megatron_p2r.arguments import config_from_values
from megatron_p2r.planning.activations import attention_core_bytes, korthikanti_layer_bytes, layer_activations

MODELS = {"22B": (64, 6144), "175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600)}
SEQ, TP = 2048, 8
VARIANTS = {  # name: (tp, sequence parallel, selective recomputation)
    "none": (1, False, False), "TP": (TP, False, False), "TP+SP": (TP, True, False),
    "TP+sel": (TP, False, True), "TP+SP+sel": (TP, True, True)}


def config(heads: int, hidden: int, micro_batch: int, selective: bool, tp: int, sp: bool):
    return config_from_values(dict(num_layers=2, hidden_size=hidden, num_attention_heads=heads, seq_length=SEQ,
                                   vocab_size=51200, micro_batch_size=micro_batch, bf16=True, hidden_dropout=0.1,
                                   attention_dropout=0.1, mock_data=True, recompute_activations=selective,
                                   tensor_model_parallel_size=tp, sequence_parallel=sp))


def explained(cfg, tp: int, sp: bool, selective: bool) -> int:
    """planner - paper, from the differences docs/scale.md lists."""
    m, b = cfg.model, cfg.train.micro_batch_size
    tokens = SEQ * b // (tp if sp else 1)                 # tokens outside the TP regions
    out = 2 * tokens * 8                                   # two LayerNorms' fp32 mean and rstd
    if not selective:
        out += attention_core_bytes(cfg, tp) - 5 * m.num_attention_heads * SEQ * SEQ * b // tp
    return out


def rows(micro_batch: int = 1):
    """(model, variant, planner bytes, paper bytes, explained difference) per layer."""
    for name, (heads, hidden) in MODELS.items():
        for variant, (tp, sp, selective) in VARIANTS.items():
            cfg = config(heads, hidden, micro_batch, selective, tp, sp)
            ours = layer_activations(cfg, 0, tp, 1, sequence_parallel=sp).held
            paper = korthikanti_layer_bytes(SEQ, micro_batch, hidden, heads, tp, sequence_parallel=sp,
                                            selective=selective)
            yield name, variant, ours, paper, explained(cfg, tp, sp, selective)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args(argv)
    print("| model | variant | planner MiB | Korthikanti MiB | planner / paper | explained difference MiB |")
    print("|---|---|---|---|---|---|")
    for name, variant, ours, paper, diff in rows(args.micro_batch):
        print(f"| {name} | {variant} | {ours / 2**20:.1f} | {paper / 2**20:.1f} | {ours / paper:.2f} | "
              f"{diff / 2**20:+.1f}{'' if ours - paper == diff else ' (UNEXPLAINED)'} |")


if __name__ == "__main__":
    main()
