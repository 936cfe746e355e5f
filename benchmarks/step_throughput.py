"""Training-step throughput: megatron_p2r vs Hugging Face GPT2LMHeadModel vs a plain-PyTorch GPT,
same shape and precision, one run; and the loss's share of our step.

    python benchmarks/step_throughput.py [--steps 10] [--rounds 3] [--bf16] [--device cpu|cuda] [--cpu-time]
                                         [--compile] [--tiny] [--json PATH]

Shape: vocab 8192, hidden 256, 4 layers, 4 heads, seq 256, micro-batch 8, AdamW,
gradient clipping. ``--bf16``: ours as training runs it (bf16 weights, fp32 mains in the
optimizer, no autocast), the other two under bf16 autocast over fp32 weights. The
plain GPT is what one writes with torch alone: fused QKV, SDPA, GELU, tied embeddings,
``F.cross_entropy`` on the fp32 logits, fused AdamW. Prints tokens/s of each (interleaved
rounds, medians), the ratios, the device's matmul ceiling (benchmarks/measure.py) measured in
the same run, our model FLOP/s as a fraction of it, and the loss's share of our step from a
profile: the fused output layer + cross entropy (``parallel/cross_entropy.py``) minus its
matmuls, which are the three any output layer needs (logits, input and weight gradients):
what remains is the log-sum-exp, the softmax gradient and their bookkeeping. ``--json`` writes the same figures (the
GPU lane's report reads them). ``--cpu-time`` (CPU only) counts this process's CPU time
instead of wall time: on a shared machine other sessions' load then does not move the figures
(run with one thread). Pins glibc malloc thresholds (docs/machine.md), or figures
drift by ~20%. ``--compile`` adds ours with ``--compile`` (each layer's forward through
torch.compile, inductor; compiled in the warm-up steps) beside ours eager, and their ratio. ``--tiny`` (2 layers of hidden 64, seq 64; the ceiling
from a 1024^3 product) checks the script in seconds: the GPU lane's trial on CPU runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import pinned_malloc  # noqa: E402,F401  (re-executes with malloc pinned; must precede torch)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from measure import matmul_ceiling, random_microbatches, timed, write_json  # noqa: E402
from megatron_p2r.arguments import config_from_values  # noqa: E402
from megatron_p2r.metrics import model_flops_per_token  # noqa: E402
from megatron_p2r.parallel.state import ParallelState  # noqa: E402
from megatron_p2r.training import build_train_state, train_step  # noqa: E402

SHAPE = dict(
    vocab_size=8192,
    make_vocab_size_divisible_by=128,
    hidden_size=256,
    num_layers=4,
    num_attention_heads=4,
    seq_length=256,
    micro_batch_size=8,
    mock_data=True,
    clip_grad=1.0,
    weight_decay=0.01,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=2, seq_length=64, micro_batch_size=2)
LOSS_FORWARD, LOSS_BACKWARD = "_OutputCrossEntropy", "_OutputCrossEntropyBackward"


def ours(cfg, batch, device):
    state = build_train_state(cfg, ParallelState.single(device))
    return lambda: train_step(state, [batch])


def _precision(cfg, device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if cfg.train.bf16 else contextlib.nullcontext()


def _optimizer_step(model, opt, loss):
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def huggingface(cfg, batch, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    m = cfg.model
    hf_cfg = GPT2Config(
        vocab_size=m.padded_vocab_size,
        n_positions=m.seq_length,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_attention_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(hf_cfg).to(device)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = batch["tokens"]

    def step():
        opt.zero_grad(set_to_none=True)
        with _precision(cfg, device):
            out = model(input_ids=tokens, labels=tokens)  # HF shifts labels internally
        _optimizer_step(model, opt, out.loss)

    return step


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """A GPT as one writes it with torch alone (the same shape and parameters as ours)."""

    def __init__(self, vocab: int, h: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain(cfg, batch, device):
    m = cfg.model
    model = PlainGPT(m.padded_vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.seq_length).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with _precision(cfg, device):
            loss = model(batch["tokens"], batch["labels"])
        _optimizer_step(model, opt, loss)

    return step


def _descendants(event, name: str):
    for child in event.cpu_children:
        if child.name == name:
            yield child
        else:
            yield from _descendants(child, name)


def loss_share(step, steps: int, device) -> dict:
    """From a profile of ``steps`` steps: the share of the step spent in the fused output layer +
    loss, and in the loss alone: that minus its matmuls (the fused loss computes the three any
    output layer needs -- logits, input and weight gradients -- and no others). Wall time on
    CPU (a share: other load inflates both sides); on CUDA the kernels' time."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        elapsed_us = timed(lambda: [step() for _ in range(steps)], device) * 1e6
    events = prof.events()
    busy = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    total = sum(busy(e) for e in events if e.cpu_parent is None) if cuda else elapsed_us
    head = [e for e in events if e.name in (LOSS_FORWARD, LOSS_BACKWARD)]
    matmuls = sum(busy(mm) for e in head for mm in _descendants(e, "aten::mm"))
    head_time = sum(busy(e) for e in head)
    return {"output_layer_and_loss": head_time / total, "loss": (head_time - matmuls) / total}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--bf16", action="store_true", help="bf16: ours with bf16 weights, the others under autocast")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-time", action="store_true", help="on CPU: time by this process's CPU time")
    parser.add_argument("--compile", action="store_true", help="also ours with --compile, beside ours eager")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized shape (checks the script)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = {**SHAPE, **TINY} if args.tiny else SHAPE
    if args.cpu_time and device.type != "cpu":
        parser.error("--cpu-time measures CPU runs only")
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    cfg = config_from_values(dict(shape, bf16=args.bf16, device=args.device))
    batch = random_microbatches(shape["vocab_size"], shape["seq_length"], shape["micro_batch_size"], device)[0]
    runners = {"megatron_p2r": ours(cfg, batch, device), "plain_gpt": plain(cfg, batch, device)}
    if args.compile:
        runners["megatron_p2r_compiled"] = ours(cfg.replace(compile=True), batch, device)
    try:
        runners["hf_gpt2"] = huggingface(cfg, batch, device)
    except ImportError:
        print("transformers not installed (pip install -e .[bench]): no Hugging Face figure")
    tokens = shape["micro_batch_size"] * shape["seq_length"]
    rates = {k: [] for k in runners}
    for name, fn in runners.items():  # warm-up
        for _ in range(2):
            fn()
    for _ in range(args.rounds):
        for name, fn in runners.items():
            rates[name].append(args.steps * tokens / timed(lambda: [fn() for _ in range(args.steps)], device, clock))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ceiling = matmul_ceiling(device, dtype, n=1024 if args.tiny else None, clock=clock)
    share = loss_share(runners["megatron_p2r"], args.steps, device)
    med = {k: statistics.median(v) for k, v in rates.items()}
    flops = model_flops_per_token(cfg.model) * med["megatron_p2r"]
    print(
        f"device {device}, threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, "
        f"{'bf16 (ours: bf16 weights; others: autocast)' if args.bf16 else 'fp32'}, {'CPU' if args.cpu_time else 'wall'} time"
    )
    for k, v in med.items():
        print(f"{k:>{max(14, len(k))}}: {v:9.0f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[k])})")
    ratios = {f"ours_over_{k}": med["megatron_p2r"] / v for k, v in med.items() if not k.startswith("megatron_p2r")}
    if args.compile:
        ratios["compiled_over_eager"] = med["megatron_p2r_compiled"] / med["megatron_p2r"]
    for k, v in ratios.items():
        print(f"{'ratio':>14}: {v:.2f}x ({k.replace('_', ' ')})")
    print(
        f"{'matmul ceiling':>14}: {ceiling / 1e9:.0f} GFLOP/s; ours achieves {flops / 1e9:.0f} GFLOP/s "
        f"= {flops / ceiling:.0%} of it"
    )
    print(
        f"{'loss share':>14}: {share['loss']:.1%} of our step (output layer + loss: "
        f"{share['output_layer_and_loss']:.1%})"
    )
    write_json(
        args.json,
        {
            "device": str(device),
            "dtype": str(dtype).replace("torch.", ""),
            "shape": shape,
            "tokens_per_s": med,
            "rounds": rates,
            "ratio_ours_over_hf": ratios.get("ours_over_hf_gpt2"),
            "ratio_ours_over_plain": ratios["ours_over_plain_gpt"],
            "ratio_compiled_over_eager": ratios.get("compiled_over_eager"),
            "matmul_ceiling_flops": ceiling,
            "ours_flops": flops,
            "fraction_of_ceiling": flops / ceiling,
            "loss_share": share,
            "clock": "cpu" if args.cpu_time else "wall",
        },
    )


if __name__ == "__main__":
    main()
