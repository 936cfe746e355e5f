"""Training-step throughput: megatron_p2r vs Hugging Face GPT2LMHeadModel, same shape, one run.

    python benchmarks/step_throughput.py [--steps 10] [--rounds 3] [--bf16] [--device cpu|cuda] [--json PATH]

Shape (issue #2): vocab 8192, hidden 256, 4 layers, 4 heads, seq 256, micro-batch 8, AdamW.
``--bf16`` runs both models under bf16 autocast (fp32 weights), so the two are compared at
the same precision. Prints tokens/s of both (interleaved rounds, medians), the ratio, the
device's matmul ceiling (benchmarks/measure.py) and our model FLOP/s as a fraction of it;
``--json`` writes the same figures (the GPU lane's report reads them). Pins glibc malloc
thresholds the way shared/MACHINE.md advises, or figures drift by ~20%.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402

from measure import matmul_ceiling, random_microbatches, timed, write_json  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.metrics import model_flops_per_token  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SHAPE = dict(vocab_size=8192, make_vocab_size_divisible_by=128, hidden_size=256, num_layers=4,
             num_attention_heads=4, seq_length=256, micro_batch_size=8, mock_data=True,
             clip_grad=1.0, weight_decay=0.01, hidden_dropout=0.0, attention_dropout=0.0)


def ours(cfg, batch, device):
    state = build_train_state(cfg, ParallelState.single(device))
    return lambda: train_step(state, [batch])


def huggingface(cfg, batch, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    m = cfg.model
    hf_cfg = GPT2Config(vocab_size=m.padded_vocab_size, n_positions=m.seq_length, n_embd=m.hidden_size,
                        n_layer=m.num_layers, n_head=m.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(hf_cfg).to(device)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = batch["tokens"]

    def step():
        opt.zero_grad(set_to_none=True)
        precision = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.train.bf16
                     else contextlib.nullcontext())
        with precision:
            out = model(input_ids=tokens, labels=tokens)  # HF shifts labels internally
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for both models")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = config_from_values(dict(SHAPE, bf16=args.bf16, device=args.device))
    batch = random_microbatches(SHAPE["vocab_size"], SHAPE["seq_length"], SHAPE["micro_batch_size"], device)[0]
    runners = {"megatron_p2r": ours(cfg, batch, device)}
    try:
        runners["hf_gpt2"] = huggingface(cfg, batch, device)
    except ImportError:
        print("transformers not installed (pip install -e .[bench]): measuring ours only")
    tokens = SHAPE["micro_batch_size"] * SHAPE["seq_length"]
    rates = {k: [] for k in runners}
    for name, fn in runners.items():  # warm-up
        for _ in range(2):
            fn()
    for _ in range(args.rounds):
        for name, fn in runners.items():
            rates[name].append(args.steps * tokens / timed(lambda: [fn() for _ in range(args.steps)], device))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ceiling = matmul_ceiling(device, dtype)
    med = {k: statistics.median(v) for k, v in rates.items()}
    flops = model_flops_per_token(cfg.model) * med["megatron_p2r"]
    print(f"device {device}, threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, "
          f"{'bf16' if args.bf16 else 'fp32'}")
    for k, v in med.items():
        print(f"{k:>14}: {v:9.0f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[k])})")
    ratio = med["megatron_p2r"] / med["hf_gpt2"] if "hf_gpt2" in med else None
    if ratio is not None:
        print(f"{'ratio':>14}: {ratio:.2f}x (ours / HF)")
    print(f"{'matmul ceiling':>14}: {ceiling / 1e9:.0f} GFLOP/s; ours achieves {flops / 1e9:.0f} GFLOP/s "
          f"= {flops / ceiling:.0%} of it")
    write_json(args.json, {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "shape": SHAPE,
                           "tokens_per_s": med, "rounds": rates, "ratio_ours_over_hf": ratio,
                           "matmul_ceiling_flops": ceiling, "ours_flops": flops,
                           "fraction_of_ceiling": flops / ceiling})


if __name__ == "__main__":
    main()
