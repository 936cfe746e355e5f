"""MoE layer: speed against Hugging Face Mixtral's block, and all-to-all bytes against the minimum.

    python benchmarks/moe_layer.py [--rounds 5] [--iters 3] [--bf16] [--skip-ep]

1. One process: hidden 256, expert FFN 512, 8 SwiGLU experts, top-2 (renormalised, as
   Mixtral), 2048 tokens. Forward + backward of ``moe.layer.MoELayer`` against
   ``transformers`` ``MixtralSparseMoeBlock`` holding the *same weights* (the outputs are
   compared first), under its experts implementations: the eager loop over experts (the
   default) and grouped_mm (batched_mm on request). Interleaved rounds, medians; ratio = their time / ours (>= 1: we are faster).
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

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296",
              "MALLOC_TOP_PAD_": "536870912"}
if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):  # must be set before the process starts
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

from megatron_p2r.config import ModelConfig  # noqa: E402
from megatron_p2r.moe.layer import MoELayer  # noqa: E402
from megatron_p2r.parallel.sharding import init_parameters  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 256, 512, 8, 2, 2048


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_experts=EXPERTS,
                       moe_ffn_hidden_size=FFN, moe_router_topk=TOPK, moe_router_pre_softmax=False, swiglu=True,
                       disable_bias_linear=True)


def our_layer(ps: ParallelState) -> MoELayer:
    layer = MoELayer(model_config(), ps)
    init_parameters(layer, seed=1, tp_rank=0, tp_size=1, ep_rank=ps.ep_rank)
    return layer


def mixtral_block(ours: MoELayer, implementation: str):
    """MixtralSparseMoeBlock with our weights (gate/up rows de-interleaved into [gate; up])."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOPK, router_jitter_noise=0.0)
    cfg._experts_implementation = implementation
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        w1 = ours.experts.weight1
        block.experts.gate_up_proj.copy_(torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1))
        block.experts.down_proj.copy_(ours.experts.weight2)
    return block


def speed(rounds: int, iters: int, bf16: bool, implementations) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    ours = our_layer(ParallelState.single())
    x = torch.randn(8, TOKENS // 8, HIDDEN)
    g = torch.randn_like(x)
    contenders = {"ours": ours}
    for impl in implementations:
        contenders[f"mixtral/{impl}"] = mixtral_block(ours, impl)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step(module):
        xx = x.clone().requires_grad_()
        with autocast():
            out = module(xx)
        (out.float() * g).sum().backward()
        module.zero_grad(set_to_none=True)
        return out

    with torch.no_grad():
        reference = ours(x)
        for name, module in contenders.items():
            err = (module(x) - reference).abs().max().item()
            print(f"{name:22s} max |output - ours| = {err:.2e}")
    times = {name: [] for name in contenders}
    for name, module in contenders.items():  # warm-up
        step(module)
    for _ in range(rounds):
        for name, module in contenders.items():
            start = time.perf_counter()
            for _ in range(iters):
                step(module)
            times[name].append((time.perf_counter() - start) / iters)
    ours_t = statistics.median(times["ours"])
    print(f"\nforward+backward, {TOKENS} tokens, hidden {HIDDEN}, expert FFN {FFN}, {EXPERTS} SwiGLU experts, "
          f"top-{TOPK}, {'bf16 autocast' if bf16 else 'fp32'}, 2 threads; medians of {rounds} rounds x {iters}")
    for name, t in times.items():
        med = statistics.median(t)
        ratio = "" if name == "ours" else f"   ratio (theirs / ours) {med / ours_t:.2f}"
        print(f"{name:22s} {1000 * med:8.1f} ms  (min {1000 * min(t):.1f}){ratio}")


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
    from megatron_p2r.testing import run_distributed
    results = run_distributed(_bytes_worker, 2, bf16)
    print(f"\nEP=2 on 2 processes, {TOKENS} tokens per rank, top-{TOPK}, {'bf16' if bf16 else 'fp32'} rows: "
          "bytes sent to the other rank")
    row_bytes = HIDDEN * (2 if bf16 else 4)
    for rank, r in enumerate(results):
        # this rank sends its off-rank rows out, and returns the peer's off-rank rows after the experts
        minimum = row_bytes * (r["off_rank"] + results[1 - rank]["off_rank"])
        fwd = r["forward"]["payload"] + r["forward"]["counts"]
        step = r["step"]["payload"] + r["step"]["counts"]
        print(f"rank {rank}: {100 * r['off_rank'] / r['assignments']:.1f}% of its {r['assignments']} assignments "
              f"off-rank; forward sends {fwd:,} B (rows {r['forward']['payload']:,} + split sizes "
              f"{r['forward']['counts']}) vs minimum {minimum:,} B = {fwd / minimum:.5f}x; "
              f"forward+backward {step:,} B = {step / (2 * minimum):.5f}x of 2x the minimum")
    total_min = sum(row_bytes * r["off_rank"] for r in results) * 2
    total_fwd = sum(r["forward"]["payload"] + r["forward"]["counts"] for r in results)
    print(f"both ranks: forward {total_fwd:,} B vs tokens x hidden x dtype x 2 x off-rank fraction "
          f"= {total_min:,} B ({total_fwd / total_min:.5f}x)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (needs a CPU with a bf16 matmul path)")
    parser.add_argument("--skip-ep", action="store_true", help="only the one-process comparison")
    parser.add_argument("--mixtral-impls", nargs="+", default=["eager", "grouped_mm"],
                        choices=["eager", "batched_mm", "grouped_mm"],
                        help="transformers experts implementations to time (batched_mm copies every token's "
                             "expert weights: ~50x slower here, so not by default)")
    args = parser.parse_args(argv)
    speed(args.rounds, args.iters, args.bf16, args.mixtral_impls)
    if not args.skip_ep:
        all_to_all_bytes(args.bf16)


if __name__ == "__main__":
    main()
