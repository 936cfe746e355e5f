"""--moe-grouped-gemm in one process: the experts through torch's grouped_mm give the padded bmm
path's outputs and gradients (input and every parameter) on jagged counts — an empty expert, one
expert with every row, equal counts, no rows at all — fp32 and bf16, GELU, SwiGLU and gpt-oss's
clamped quick-GeGLU, with and without biases; under autocast and recomputation; and they fall back to padded bmm, saying so
once, where grouped_mm does not run. Under EP and TP: the grouped/ cases of
test_expert_parallel.py.

Tolerances. fp32: 1e-5 relative to each tensor's largest element (observed <= 2.6e-7: the same
products, summed in another order). bf16 against the float64 computation on the same bf16
weights: both paths within BF16_REL of each tensor's largest element (observed <= 9.6e-3 for
both; with biases grouped_mm adds bias1 after rounding its product to bf16 where baddbmm adds it
before, one more rounding: 6.7e-3 against padded's 5.7e-3).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_p2r.moe.experts import Experts
from megatron_p2r.moe.grouped_mm import grouped_mm_runs
from megatron_p2r.parallel.state import ParallelState
from tests.moe.common import HIDDEN, layer_cfg

FP32_REL = 1e-5
BF16_REL = 2e-2
COUNTS = {"jagged": [5, 0, 9, 2], "one-expert": [0, 0, 16, 0], "equal": [4, 4, 4, 4], "none": [0, 0, 0, 0]}
VARIANTS = {
    "gelu": dict(disable_bias_linear=True),
    "gelu-bias": dict(),
    "swiglu": dict(swiglu=True, disable_bias_linear=True),
    "swiglu-bias": dict(swiglu=True),
    # gpt-oss's gate: quick-GELU, offset, clamp (clamped at 0.5: weights of std 0.3 reach it)
    "geglu-clamp-bias": dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5),
}


def expert_pair(dtype=torch.float32, **overrides):
    """(padded, grouped): the same experts, random weights and biases, in ``dtype``."""
    padded = Experts(layer_cfg(**overrides), ParallelState.single())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in padded.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    padded = padded.to(dtype)
    grouped = copy.deepcopy(padded)
    grouped.grouped_gemm = True
    return padded, grouped


def rows(counts, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), HIDDEN, generator=g)
    return x.to(dtype), torch.randn(sum(counts), HIDDEN, generator=g)


def run(experts, x, g, counts, context=None):
    """(output, {name: gradient}) of sum(experts(x) * g), the input's gradient as "x"."""
    x = x.clone().requires_grad_()
    fn = (lambda v: experts(v, counts)) if context is None else (lambda v: context(lambda w: experts(w, counts), v))
    out = fn(x)
    (out.float() * g).sum().backward()
    grads = {n: p.grad.float() for n, p in experts.named_parameters()}
    grads["x"] = x.grad.float()
    experts.zero_grad(set_to_none=True)
    return out.detach().float(), grads


def worst(a, b) -> float:
    """Largest difference relative to the largest element of ``b``; 0 only when ``a`` equals an
    all-zero (an expert with no rows) or empty ``b``."""
    if not torch.count_nonzero(b):
        return 0.0 if torch.equal(a, b) else float("inf")
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture
def grouped_calls(monkeypatch):
    """The rows of every grouped_mm call (the probe's that decides whether it runs too, once)."""
    calls = []
    original = F.grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    grouped_mm_runs.cache_clear()
    monkeypatch.setattr(F, "grouped_mm", counting)
    yield calls
    grouped_mm_runs.cache_clear()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("counts", list(COUNTS))
def test_grouped_equals_padded_fp32(variant, counts, grouped_calls):
    padded, grouped = expert_pair(**VARIANTS[variant])
    x, g = rows(COUNTS[counts])
    want, want_grads = run(padded, x, g, COUNTS[counts])
    assert not grouped_calls
    run(grouped, x, g, COUNTS[counts])  # the probe runs first
    grouped_calls.clear()
    out, grads = run(grouped, x, g, COUNTS[counts])
    assert grouped_calls[:2] == [sum(COUNTS[counts])] * 2  # forward: fc1 (gated: gates and ups in one), fc2
    assert out.shape == want.shape and worst(out, want) <= FP32_REL
    for name, want_grad in want_grads.items():
        assert worst(grads[name], want_grad) <= FP32_REL, name


def float64_run(experts, x, g, counts):
    """The same computation on the same (rounded) weights and input in float64."""
    ref = copy.deepcopy(experts).double()
    ref.grouped_gemm = False
    return run(ref, x.double(), g.double(), counts)


@pytest.mark.parametrize("variant", ["gelu-bias", "swiglu", "swiglu-bias"])
def test_grouped_bf16_as_close_as_padded_bf16(variant, grouped_calls):
    """--bf16 training: both paths within BF16_REL of float64 on the same bf16 weights."""
    padded, grouped = expert_pair(torch.bfloat16, **VARIANTS[variant])
    counts = COUNTS["jagged"]
    x, g = rows(counts, torch.bfloat16)
    want, want_grads = float64_run(padded, x, g, counts)
    for experts in (padded, grouped):
        out, grads = run(experts, x, g, counts)
        assert worst(out, want) <= BF16_REL
        for name, want_grad in want_grads.items():
            assert worst(grads[name], want_grad) <= BF16_REL, name
    assert grouped_calls


def test_grouped_under_autocast_no_grad_and_recomputation(grouped_calls):
    """fp32 weights under bf16 autocast: the weights are cast as autocast casts them for bmm;
    the first call may come inside a recomputed forward or with gradients off."""
    padded, grouped = expert_pair(**VARIANTS["swiglu"])
    counts = COUNTS["jagged"]
    x, g = rows(counts)

    def autocast(fn, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(v.to(torch.bfloat16))

    def recompute(fn, v):
        return checkpoint(fn, v, use_reentrant=False)

    with torch.no_grad():
        assert worst(grouped(x, counts), padded(x, counts)) <= FP32_REL
    for context, tol in ((autocast, BF16_REL), (recompute, FP32_REL)):
        grouped_mm_runs.cache_clear()
        want, want_grads = run(padded, x, g, counts, context)
        out, grads = run(grouped, x, g, counts, context)
        assert out.dtype == want.dtype and worst(out, want) <= tol
        for name, want_grad in want_grads.items():
            assert worst(grads[name], want_grad) <= tol, (context.__name__, name)
    assert grouped_calls


def test_grouped_accepts_a_gradient_with_zero_strides(grouped_calls):
    """sum()'s gradient is one element expanded (zero strides), which grouped_mm's own backward
    rejects."""
    padded, grouped = expert_pair(**VARIANTS["swiglu"])
    counts = COUNTS["jagged"]
    x = rows(counts)[0]
    for experts in (padded, grouped):
        experts(x, counts).sum().backward()
    for (name, p), q in zip(padded.named_parameters(), grouped.parameters(), strict=True):
        assert worst(q.grad, p.grad) <= FP32_REL, name
    assert grouped_calls


@pytest.mark.parametrize("dtype,ffn", [(torch.float64, 24), (torch.bfloat16, 12)])
def test_falls_back_to_padded_where_grouped_mm_does_not_run(dtype, ffn, grouped_calls, caplog):
    """float64 (grouped_mm has no such kernel) and bf16 rows of 12 elements (24 bytes: grouped_mm
    wants strides in multiples of 16 bytes): padded bmm, one log line that says why."""
    padded, grouped = expert_pair(dtype, moe_ffn_hidden_size=ffn)
    counts = COUNTS["jagged"]
    x, g = rows(counts, dtype)
    with caplog.at_level(logging.WARNING, logger="megatron_p2r.moe.grouped_mm"):
        for _ in range(2):
            want, want_grads = run(padded, x, g, counts)
            out, grads = run(grouped, x, g, counts)
    assert torch.equal(out, want) and all(torch.equal(grads[n], w) for n, w in want_grads.items())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"grouped_mm cannot run the experts in {dtype} on cpu" in lines[0] and "padded bmm" in lines[0]
    assert all(n == 3 for n in grouped_calls), "grouped_mm ran beyond the probe"
