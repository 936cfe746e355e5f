"""Training-step throughput: megatron_p2r vs Hugging Face GPT2LMHeadModel, same shape, one run.

    python benchmarks/step_throughput.py [--steps 10] [--bf16]

Shape (issue #2): vocab 8192, hidden 256, 4 layers, 4 heads, seq 256, micro-batch 8, AdamW,
fp32. Prints tokens/s of both (interleaved rounds, medians), the ratio, the machine's matmul
ceiling and our model FLOP/s as a fraction of it. Pins glibc malloc thresholds the way
shared/MACHINE.md advises, or figures drift by ~20%.
"""
from __future__ import annotations

import argparse
import statistics
import time

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402

from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.metrics import model_flops_per_token  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SHAPE = dict(vocab_size=8192, make_vocab_size_divisible_by=128, hidden_size=256, num_layers=4,
             num_attention_heads=4, seq_length=256, micro_batch_size=8, mock_data=True,
             clip_grad=1.0, weight_decay=0.01)


def matmul_ceiling(dtype=torch.float32, n=2048, reps=10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def ours(cfg, batch):
    state = build_train_state(cfg, ParallelState.single())
    mb = [{"tokens": batch[:, :-1], "labels": batch[:, 1:], "loss_mask": torch.ones(batch.shape[0], batch.shape[1] - 1)}]
    return lambda: train_step(state, mb)


def huggingface(cfg, batch):
    from transformers import GPT2Config, GPT2LMHeadModel
    m = cfg.model
    hf_cfg = GPT2Config(vocab_size=m.padded_vocab_size, n_positions=m.seq_length, n_embd=m.hidden_size,
                        n_layer=m.num_layers, n_head=m.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(hf_cfg)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = batch[:, :-1]

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens)  # HF shifts labels internally
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for ours (HF stays fp32)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = config_from_values(dict(SHAPE, bf16=args.bf16))
    batch = torch.randint(0, 8192, (8, 257))
    runners = {"megatron_p2r": ours(cfg, batch)}
    try:
        runners["hf_gpt2"] = huggingface(cfg, batch)
    except ImportError:
        print("transformers not installed (pip install -e .[bench]): measuring ours only")
    tokens = 8 * 256
    rates = {k: [] for k in runners}
    for name, fn in runners.items():  # warm-up
        for _ in range(2):
            fn()
    for _ in range(args.rounds):
        for name, fn in runners.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                fn()
            rates[name].append(args.steps * tokens / (time.perf_counter() - t))
    ceiling = matmul_ceiling(torch.bfloat16 if args.bf16 else torch.float32)
    med = {k: statistics.median(v) for k, v in rates.items()}
    flops = model_flops_per_token(cfg.model) * med["megatron_p2r"]
    print(f"threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, "
          f"{'bf16' if args.bf16 else 'fp32'}")
    for k, v in med.items():
        print(f"{k:>14}: {v:9.0f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[k])})")
    if "hf_gpt2" in med:
        print(f"{'ratio':>14}: {med['megatron_p2r'] / med['hf_gpt2']:.2f}x (ours / HF)")
    print(f"{'matmul ceiling':>14}: {ceiling / 1e9:.0f} GFLOP/s; ours achieves {flops / 1e9:.0f} GFLOP/s "
          f"= {flops / ceiling:.0%} of it")


if __name__ == "__main__":
    main()
