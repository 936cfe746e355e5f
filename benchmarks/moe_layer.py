"""MoE layer: speed against Hugging Face Mixtral's block, and all-to-all bytes against the minimum.

    python benchmarks/moe_layer.py [--rounds 5] [--iters 3] [--bf16] [--cpu-time] [--skip-ep] [--skew 0.25] [--profile]

1. One process: hidden 256, expert FFN 512, 8 SwiGLU experts, top-2 (renormalised, as
   Mixtral), 2048 tokens, at balanced routing (a random router) and imbalanced routing (a
   router bias falling from +skew on expert 0 to -skew on the last). Forward + backward of
   ``moe.layer.MoELayer`` with the padded experts (the default) and with ``--moe-grouped-gemm``
   side by side, against ``transformers`` ``MixtralSparseMoeBlock`` holding the *same weights*
   (the outputs are compared first), under its experts implementations: the eager loop over
   experts (the default) and grouped_mm (batched_mm on request). Interleaved rounds, medians;
   each time is also given as a multiple of ours/padded's and ours/grouped's (> 1: slower than
   ours), and the experts' matmul FLOP/s on the routed rows as a fraction of the matmul ceiling
   measured in the same run (benchmarks/measure.py).
2. Two gloo processes, EP=2, 2048 tokens per rank: bytes this rank's all-to-alls send to the
   other rank per forward (and per forward + backward) against the minimum
   tokens x hidden x dtype bytes x 2 (there and back) x fraction of assignments routed off-rank
   (with top-2 a token counts once per assignment: rows are not deduplicated).

Pins glibc malloc thresholds (docs/machine.md: figures drift otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "536870912",
}
if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):  # must be set before the process starts
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.harness: local gloo ranks

import torch  # noqa: E402

from measure import matmul_ceiling, self_cpu_times, timed  # noqa: E402
from megatron_p2r.config import ModelConfig  # noqa: E402
from megatron_p2r.moe.layer import MoELayer  # noqa: E402
from megatron_p2r.parallel.sharding import init_parameters  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 256, 512, 8, 2, 2048


def model_config(grouped: bool = False) -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=TOPK,
        moe_router_pre_softmax=False,
        swiglu=True,
        disable_bias_linear=True,
        moe_grouped_gemm=grouped,
    )


def our_layer(ps: ParallelState, grouped: bool = False) -> MoELayer:
    layer = MoELayer(model_config(grouped), ps)
    init_parameters(layer, seed=1, tp_rank=0, tp_size=1, ep_rank=ps.ep_rank)
    return layer


def mixtral_block(ours: MoELayer, implementation: str):
    """MixtralSparseMoeBlock with our weights (gate/up rows de-interleaved into [gate; up])."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        router_jitter_noise=0.0,
    )
    cfg._experts_implementation = implementation
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        w1 = ours.experts.weight1
        block.experts.gate_up_proj.copy_(torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1))
        block.experts.down_proj.copy_(ours.experts.weight2)
    return block


def routed_inputs(layer: MoELayer, skew: float):
    """(x, upstream gradient) of TOKENS tokens. ``skew`` > 0 makes routing imbalanced: feature 0
    is a constant 1 and the router reads it as a bias falling linearly from +skew (expert 0) to
    -skew (the last expert)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, TOKENS // 8, HIDDEN, generator=g)
    if skew:
        x[..., 0] = 1.0
        with torch.no_grad():
            layer.router.weight[:, 0] = torch.linspace(skew, -skew, EXPERTS)
    return x, torch.randn(x.shape, generator=g)


def expert_loads(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Assignments per expert over the balanced share (1.0 = even)."""
    with torch.no_grad():
        indices = layer.router(x.reshape(-1, HIDDEN)).indices
    return torch.bincount(indices.reshape(-1), minlength=EXPERTS) * EXPERTS / indices.numel()


def contenders(skew: float, implementations):
    """(x, g, loads, {name: module}): our layer with the padded and the grouped experts and
    Mixtral's blocks, all holding the same weights."""
    padded = our_layer(ParallelState.single())
    x, g = routed_inputs(padded, skew)
    grouped = our_layer(ParallelState.single(), grouped=True)
    grouped.load_state_dict(padded.state_dict())
    modules = {"ours/padded": padded, "ours/grouped": grouped}
    for impl in implementations:
        modules[f"mixtral/{impl}"] = mixtral_block(padded, impl)
    return x, g, expert_loads(padded, x), modules


def training_step(x, g, autocast):
    """One forward + backward of a module on ``x`` with upstream gradient ``g``."""

    def step(module):
        xx = x.clone().requires_grad_()
        with autocast():
            out = module(xx)
        (out.float() * g).sum().backward()
        module.zero_grad(set_to_none=True)

    return step


def time_contenders(modules: dict, x, g, rounds: int, iters: int, autocast, clock) -> dict:
    """{name: seconds per forward+backward}: medians of interleaved rounds after a warm-up; the
    outputs are compared with ours/padded first."""
    step = training_step(x, g, autocast)
    with torch.no_grad(), autocast():
        reference = modules["ours/padded"](x).float()
        for name, module in modules.items():
            print(f"  {name:18s} max |output - ours/padded| = {(module(x).float() - reference).abs().max().item():.2e}")
    times = {name: [] for name in modules}
    for module in modules.values():
        step(module)
    for _ in range(rounds):
        for name, module in modules.items():
            times[name].append(
                timed(lambda m=module: [step(m) for _ in range(iters)], torch.device("cpu"), clock) / iters
            )
    return {name: statistics.median(t) for name, t in times.items()}


def speed(
    rounds: int, iters: int, bf16: bool, implementations, skew: float, cpu_time: bool, profile: bool = False
) -> None:
    threads, clock = (1, time.process_time) if cpu_time else (2, time.perf_counter)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    ceiling = matmul_ceiling(torch.device("cpu"), dtype, clock=clock)
    # expert matmuls of a forward + backward (3x the forward's), on the routed rows only
    expert_flops = 3 * 2 * TOKENS * TOPK * 3 * FFN * HIDDEN
    print(
        f"forward+backward, {TOKENS} tokens, hidden {HIDDEN}, expert FFN {FFN}, {EXPERTS} SwiGLU experts, "
        f"top-{TOPK}, {'bf16 autocast' if bf16 else 'fp32'}, {threads} thread(s), "
        f"{'CPU' if cpu_time else 'wall'} time; medians of {rounds} rounds x {iters}"
    )
    print(
        f"matmul ceiling ({dtype}, 2048^3): {ceiling / 1e9:.0f} GFLOP/s; "
        f"the experts' matmuls: {expert_flops / 1e9:.2f} GFLOP per step on the routed rows"
    )
    for routing, s in (("balanced", 0.0), ("imbalanced", skew)):
        x, g, loads, modules = contenders(s, implementations)
        padding = loads.max().item() * EXPERTS / loads.sum().item() - 1
        print(
            f"\n{routing} routing: expert loads {', '.join(f'{v:.2f}' for v in loads.tolist())} of the even share; "
            f"the padded experts multiply {100 * padding:.0f}% padding rows on top"
        )
        times = time_contenders(modules, x, g, rounds, iters, autocast, clock)
        print(f"  {'':18s} {'time':>8s}     {'/ padded':>8s} {'/ grouped':>9s}   expert FLOP/s / ceiling")
        for name, t in times.items():
            print(
                f"  {name:18s} {1000 * t:8.1f} ms  {t / times['ours/padded']:8.2f} {t / times['ours/grouped']:9.2f}"
                f"   {expert_flops / t / ceiling:.0%}"
            )
        print(f"  grouped vs padded: {times['ours/padded'] / times['ours/grouped']:.2f}x as fast")
        if profile:
            print_profile(modules, times, training_step(x, g, autocast))


# ----------------------------------------------------------------------------- where the time goes

OPERATOR_CLASSES = {  # aten operator -> class; any other operator is "other"
    "matmuls": ("mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "linear", "matmul"),
    "routing": ("_softmax", "_softmax_backward_data", "topk", "logsumexp", "bincount", "eq", "one_hot"),
    "permutation": (
        "sort",
        "argsort",
        "index_select",
        "index_copy",
        "index_copy_",
        "index_add_",
        "index_put_",
        "_index_put_impl_",
        "index",
        "scatter_add_",
        "gather",
        "nonzero",
        "where",
        "repeat_interleave",
        "cumsum",
        "arange",
    ),
    "activation": ("silu", "silu_backward", "gelu", "gelu_backward", "sigmoid"),
    "multiply-add, sums": ("mul", "add", "add_", "addcmul_", "sub", "div", "sum"),
    "casts, copies, fills": ("copy_", "_to_copy", "fill_", "zero_", "cat", "stack", "clone", "contiguous"),
}


def self_time_classes(module, step, steps: int = 3) -> dict:
    """{class: share of this module's self CPU time over ``steps`` forward+backward steps} from
    torch.profiler, classified by operator (OPERATOR_CLASSES); the loss around the module is the
    benchmark's and is counted too (one mul and one sum of [T, h])."""
    step(module)
    of = {f"aten::{op}": name for name, ops in OPERATOR_CLASSES.items() for op in ops}
    totals = {name: 0.0 for name in list(OPERATOR_CLASSES) + ["other"]}
    for key, seconds in self_cpu_times(lambda: step(module), steps).items():
        totals[of.get(key, "other")] += seconds
    whole = sum(totals.values())
    return {name: t / whole for name, t in totals.items()}


def print_profile(modules: dict, times: dict, step) -> None:
    """Each module's self CPU time by class (its measured time split in those shares), and what
    the matmul shares mean for the ratio to Mixtral."""
    print("  where the time goes (torch.profiler self CPU time by operator class, ms per step):")
    shares = {name: self_time_classes(module, step) for name, module in modules.items()}
    classes = list(next(iter(shares.values())))
    print(f"  {'':18s} " + " ".join(f"{c:>12.12s}" for c in classes))
    for name, share in shares.items():
        print(f"  {name:18s} " + " ".join(f"{1000 * times[name] * share[c]:12.1f}" for c in classes))
    ours = times["ours/grouped"] * shares["ours/grouped"]["matmuls"]
    for name in (n for n in modules if n.startswith("mixtral/")):
        print(
            f"  {name} / ours/grouped if everything but ours' matmuls were free: {times[name] / ours:.2f}x "
            f"(ours' matmuls are {shares['ours/grouped']['matmuls']:.0%} of its time)"
        )


# ----------------------------------------------------------------------------- all-to-all bytes


def _bytes_worker(rank: int, world: int, bf16: bool) -> dict:
    from megatron_p2r.parallel import mappings
    from megatron_p2r.parallel.state import Layout, initialize

    ps = initialize(Layout(dp=2, ep=2), torch.device("cpu"))
    layer = our_layer(ps)
    sent = {"payload": 0, "counts": 0}
    original = mappings._all_to_all_single

    def counting(x, out_splits, in_splits, group):
        me = torch.distributed.get_rank(group)
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        off_rank = sum(n for peer, n in enumerate(in_splits) if peer != me)
        sent["payload" if x.dim() > 1 else "counts"] += off_rank * (row if x.dim() > 1 else x.element_size())
        return original(x, out_splits, in_splits, group)

    mappings._all_to_all_single = counting
    torch.manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        routing = layer.router(x)
        out = layer(x.unsqueeze(0))
    forward = dict(sent)
    out.float().sum().backward()
    local = range(ps.ep_rank * layer.experts.num_local, (ps.ep_rank + 1) * layer.experts.num_local)
    off_rank = sum(int((routing.indices == e).sum()) for e in range(EXPERTS) if e not in local)
    return {"forward": forward, "step": dict(sent), "off_rank": off_rank, "assignments": routing.indices.numel()}


def all_to_all_bytes(bf16: bool) -> None:
    from tests.harness import run_distributed

    results = run_distributed(_bytes_worker, 2, bf16)
    print(
        f"\nEP=2 on 2 processes, {TOKENS} tokens per rank, top-{TOPK}, {'bf16' if bf16 else 'fp32'} rows: "
        "bytes sent to the other rank"
    )
    row_bytes = HIDDEN * (2 if bf16 else 4)
    for rank, r in enumerate(results):
        # this rank sends its off-rank rows out, and returns the peer's off-rank rows after the experts
        minimum = row_bytes * (r["off_rank"] + results[1 - rank]["off_rank"])
        fwd = r["forward"]["payload"] + r["forward"]["counts"]
        step = r["step"]["payload"] + r["step"]["counts"]
        print(
            f"rank {rank}: {100 * r['off_rank'] / r['assignments']:.1f}% of its {r['assignments']} assignments "
            f"off-rank; forward sends {fwd:,} B (rows {r['forward']['payload']:,} + split sizes "
            f"{r['forward']['counts']}) vs minimum {minimum:,} B = {fwd / minimum:.5f}x; "
            f"forward+backward {step:,} B = {step / (2 * minimum):.5f}x of 2x the minimum"
        )
    total_min = sum(row_bytes * r["off_rank"] for r in results) * 2
    total_fwd = sum(r["forward"]["payload"] + r["forward"]["counts"] for r in results)
    print(
        f"both ranks: forward {total_fwd:,} B vs tokens x hidden x dtype x 2 x off-rank fraction "
        f"= {total_min:,} B ({total_fwd / total_min:.5f}x)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (needs a CPU with a bf16 matmul path)")
    parser.add_argument("--skip-ep", action="store_true", help="only the one-process comparison")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, this process's CPU time instead of wall time: other load on a shared "
        "machine does not move the figures",
    )
    parser.add_argument(
        "--skew",
        type=float,
        default=0.25,
        help="router bias of the imbalanced case, from +SKEW (expert 0) down to -SKEW",
    )
    parser.add_argument(
        "--mixtral-impls",
        nargs="+",
        default=["eager", "grouped_mm"],
        choices=["eager", "batched_mm", "grouped_mm"],
        help="transformers experts implementations to time (batched_mm copies every token's "
        "expert weights: ~50x slower here, so not by default)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split each time by operator class (torch.profiler self CPU time): the experts' "
        "matmuls, routing, permutation, activation, elementwise, casts, other",
    )
    args = parser.parse_args(argv)
    speed(args.rounds, args.iters, args.bf16, args.mixtral_impls, args.skew, args.cpu_time, args.profile)
    if not args.skip_ep:
        all_to_all_bytes(args.bf16)


if __name__ == "__main__":
    main()
