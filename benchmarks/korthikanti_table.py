"""Activation bytes per transformer layer: the planner against Korthikanti et al. 2022, Table 2.

    python benchmarks/korthikanti_table.py [--micro-batch 1]
    python benchmarks/korthikanti_table.py --fits      # the paper's whole models on A100-80GB

For the paper's 22B / 175B / 530B / 1T shapes (Table 3: heads, hidden size; sequence 2048,
TP 8) with bf16, LayerNorm, GELU, biases and dropout on, the planner's per-layer activations
(``planning.activations.layer_activations``, CUDA variant) next to the paper's formulas, for
no parallelism, TP, TP + sequence parallelism, TP + selective recomputation and all three.
Prints a markdown table (docs/scale.md) and the difference the planner explains term by term:
the norms' fp32 statistics, the fused attention's log-sum-exp, and no s x s tensors (-5as^2b/t).
(With --bf16 the model holds 16-bit weights and computes without autocast, so the residual
stream and the norms' inputs are 16-bit, as in the paper.)

``--fits``: the paper's four models as its Table 3 lays them out (TP 8; PP 1, 8, 35, 64; global
batch = GPUs, micro-batch 1) planned whole on A100-80GB (``planning.estimate.make_plan``, the
worst stage, no distributed optimizer) with SP, SP + selective, neither, and full recomputation.
"""

from __future__ import annotations

import argparse

from megatron_p2r.arguments import config_from_values
from megatron_p2r.planning.activations import attention_core_bytes, korthikanti_layer_bytes, layer_activations

MODELS = {"22B": (64, 6144), "175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600)}
SEQ, TP = 2048, 8
VARIANTS = {  # name: (tp, sequence parallel, selective recomputation)
    "none": (1, False, False),
    "TP": (TP, False, False),
    "TP+SP": (TP, True, False),
    "TP+sel": (TP, False, True),
    "TP+SP+sel": (TP, True, True),
}


def config(heads: int, hidden: int, micro_batch: int, selective: bool, tp: int, sp: bool):
    return config_from_values(
        dict(
            num_layers=2,
            hidden_size=hidden,
            num_attention_heads=heads,
            seq_length=SEQ,
            vocab_size=51200,
            micro_batch_size=micro_batch,
            bf16=True,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            mock_data=True,
            recompute_activations=selective,
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
        )
    )


def explained(cfg, tp: int, sp: bool, selective: bool) -> int:
    """planner - paper, from the differences docs/scale.md lists."""
    m, b = cfg.model, cfg.train.micro_batch_size
    tokens = SEQ * b // (tp if sp else 1)  # tokens outside the TP regions
    out = 2 * tokens * 8  # two LayerNorms' fp32 mean and rstd
    if not selective:
        out += attention_core_bytes(cfg, tp) - 5 * m.num_attention_heads * SEQ * SEQ * b // tp
    return out


def rows(micro_batch: int = 1):
    """(model, variant, planner bytes, paper bytes, explained difference) per layer."""
    for name, (heads, hidden) in MODELS.items():
        for variant, (tp, sp, selective) in VARIANTS.items():
            cfg = config(heads, hidden, micro_batch, selective, tp, sp)
            ours = layer_activations(cfg, 0, tp, 1, sequence_parallel=sp).held
            paper = korthikanti_layer_bytes(
                SEQ, micro_batch, hidden, heads, tp, sequence_parallel=sp, selective=selective
            )
            yield name, variant, ours, paper, explained(cfg, tp, sp, selective)


# model: (layers, pipeline stages) in Korthikanti et al.'s Table 3; TP 8, so 8 x PP GPUs
LAYOUTS = {"22B": (48, 1), "175B": (96, 8), "530B": (105, 35), "1T": (128, 64)}
WHOLE_MODEL_VARIANTS = {
    "SP": dict(sequence_parallel=True),
    "SP+sel": dict(sequence_parallel=True, recompute_activations=True),
    "no SP": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def fits_table() -> None:
    """The worst stage of each whole model, in GiB: device total and the activations it holds
    (the first stage of a 1F1B pipeline holds PP micro-batches), and whether it fits 80 GB."""
    from megatron_p2r.planning.estimate import make_plan
    from megatron_p2r.planning.hardware import GPU_PRESETS

    gpu = GPU_PRESETS["A100-80GB"]
    print("| model | TP x PP | variant | device total GiB | activations GiB | fits |")
    print("|---|---|---|---|---|---|")
    for name, (heads, hidden) in MODELS.items():
        layers, pp = LAYOUTS[name]
        gpus = TP * pp
        for variant, flags in WHOLE_MODEL_VARIANTS.items():
            cfg = config_from_values(
                dict(
                    num_layers=layers,
                    hidden_size=hidden,
                    num_attention_heads=heads,
                    seq_length=SEQ,
                    vocab_size=51200,
                    micro_batch_size=1,
                    global_batch_size=gpus,
                    bf16=True,
                    hidden_dropout=0.1,
                    attention_dropout=0.1,
                    mock_data=True,
                    tensor_model_parallel_size=TP,
                    pipeline_model_parallel_size=pp,
                    **flags,
                )
            )
            plan = make_plan(cfg, gpus, gpu)
            worst = max(plan.stages, key=lambda st: st.device_total)
            print(
                f"| {name} | {TP} x {pp} | {variant} | {worst.device_total / 2**30:.1f} | "
                f"{worst.device['activations'] / 2**30:.1f} | {'yes' if plan.fits else 'NO'} |"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--fits", action="store_true", help="The paper's whole models planned on A100-80GB.")
    args = parser.parse_args(argv)
    if args.fits:
        fits_table()
        return
    print("| model | variant | planner MiB | Korthikanti MiB | planner / paper | explained difference MiB |")
    print("|---|---|---|---|---|---|")
    for name, variant, ours, paper, diff in rows(args.micro_batch):
        print(
            f"| {name} | {variant} | {ours / 2**20:.1f} | {paper / 2**20:.1f} | {ours / paper:.2f} | "
            f"{diff / 2**20:+.1f}{'' if ours - paper == diff else ' (UNEXPLAINED)'} |"
        )


if __name__ == "__main__":
    main()
