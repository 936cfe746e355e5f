"""Does transformers compute what we compute? Our one-process model built from a checkpoint,
compared on random ids with the exported directory loaded by transformers."""

from __future__ import annotations

import json
import os

import torch

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.convert.hf.exporter import EXPORT_DTYPES
from megatron_p2r.convert.hf.source import SourceCheckpoint
from megatron_p2r.model.m6 import build_model
from megatron_p2r.moe.expert_bias import biased_routers
from megatron_p2r.parallel.sharding import expert_key, logical_name
from megatron_p2r.parallel.state import ParallelState

# fp32 on identical weights differs only by reduction order (~1e-7 on O(1) logits)
VERIFY_TOLERANCE = 1e-4


def load_reference_model(src: str, dtype: torch.dtype = torch.float32):
    """Our one-process real model with SRC's weights (rounded to ``dtype``), and its config."""
    source = SourceCheckpoint(src)
    model = build_model(source.real_cfg, ParallelState.single(), meta=True)
    keys = {name: (logical_name(name, p), getattr(p, "expert", False)) for name, p in model.named_parameters()}
    model = model.to_empty(device="cpu")  # (allocates new parameters, without the sharding attributes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            key, expert = keys[name]
            if expert:
                for e in range(p.shape[0]):
                    p[e].copy_(source.read(expert_key(key, e)).to(dtype))
            else:
                p.copy_(source.read(key).to(dtype))
        _restore_expert_biases(model, source)
    return model.eval(), source.real_cfg


def _restore_expert_biases(model: torch.nn.Module, source: SourceCheckpoint) -> None:
    """The routers' biases (``to_empty`` left them undefined): the checkpoint's, zeros where it has
    none (a run without --moe-router-enable-expert-bias, a depth's in an older checkpoint)."""
    for name, router in biased_routers(model).items():
        router.expert_bias.zero_()
        bias = source.expert_bias(name)
        if bias is not None:
            router.expert_bias.copy_(bias)


def verify_export(src: str, dst: str, *, batch: int = 2, seq: int = 16, seed: int = 0) -> float:
    """Max |logit difference| between DST loaded by transformers and our model on random ids.

    Both run in fp32 on identical weights (ours rounded to DST's dtype), so the difference is
    only reduction order; trimmed vocabularies are compared on the rows DST has."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise HFConversionError(
            "verification needs transformers: pip install 'megatron_p2r[hf]' "
            "(the exported files are written and usable without it)"
        ) from None
    with open(os.path.join(dst, "config.json"), encoding="utf-8") as fh:
        dtype = EXPORT_DTYPES[json.load(fh)["dtype"]]
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    ours, cfg = load_reference_model(src, dtype)
    ids = torch.randint(
        0,
        cfg.model.vocab_size,
        (batch, min(seq, cfg.model.max_positions)),
        generator=torch.Generator().manual_seed(seed),
    )
    with torch.no_grad():
        a = ours(tokens=ids)
        b = hf(input_ids=ids).logits
    return (a[..., : b.shape[-1]] - b).abs().max().item()
