"""--qk-l2-norm as megatron-core's L2Norm (Llama 4's query/key norm): each query and key head
scaled to a root mean square of 1, x / sqrt(mean(x^2) + eps) with eps --norm-epsilon, computed in
fp32, before rotary embeddings; no weights. Under TP (each rank's own heads):
tests/model/test_attention.py's tp2_g4 case."""

import types

import pytest
import torch

from megatron_p2r.config import ConfigError, validate
from megatron_p2r.convert.megatron.args import SavedArgs, model_values
from megatron_p2r.convert.megatron.export_args import MegatronLayout, flags_to_pass, megatron_args
from megatron_p2r.model.m6 import build_model
from megatron_p2r.model.norm import make_qk_norm
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import tiny_config
from tests.model.test_attention import GQA, ROPE, _by_hand

EPS = 1e-5  # --norm-epsilon's default, megatron-core's layernorm_epsilon: what L2Norm is built with


def l2_by_hand(t: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """megatron-core's L2Norm._norm, written out."""
    x = t.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).type_as(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_megatrons_l2norm(dtype):
    """Small heads (mean square 1e-6, under eps 1e-5) show the eps; unit-length normalisation
    (sum instead of mean) or another eps would not match."""
    norm = make_qk_norm(tiny_config(qk_l2_norm=True).model)
    assert list(norm.parameters()) == []
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(2, 4, 16, 8, generator=g) * scale).to(dtype)
        torch.testing.assert_close(norm(x), l2_by_hand(x), rtol=0, atol=0)
    assert l2_by_hand(torch.full((8,), 1e-3))[0] < 0.5  # where the eps counts


@pytest.mark.parametrize("groups", [1, 2])
def test_attention_equals_the_written_out_computation(groups):
    """Query and key heads L2-normalised, then partially rotated, then causal softmax attention."""
    cfg = tiny_config(**ROPE, **GQA, num_query_groups=groups, kv_channels=12, qk_l2_norm=True, rotary_percent=0.5)
    model = build_model(cfg, ParallelState.single())
    attn = model.layers["0"].attention
    written = types.SimpleNamespace(
        query=attn.query, key_value=attn.key_value, proj=attn.proj, q_layernorm=l2_by_hand, k_layernorm=l2_by_hand
    )
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    rope = model.rope(16, x.device)
    torch.testing.assert_close(attn(x, rope), _by_hand(written, cfg, x), rtol=1e-5, atol=1e-5)
    plain = tiny_config(**ROPE, **GQA, num_query_groups=groups, kv_channels=12, rotary_percent=0.5)
    assert not torch.allclose(build_model(plain, ParallelState.single()).layers["0"].attention(x, rope), attn(x, rope))


def test_with_qk_layernorm_is_refused():
    with pytest.raises(ConfigError, match="--qk-l2-norm and --qk-layernorm are two query/key norms: give one"):
        validate(tiny_config(qk_l2_norm=True, qk_layernorm=True), 1)


def test_megatron_checkpoints_carry_it():
    """Imported from Megatron's args (with --qk-layernorm too: megatron-core builds the L2 norm only)
    and passed back on export (Megatron's --use-checkpoint-args does not restore it)."""
    from tests.convert.megatron import fixtures

    args = fixtures.megatron_args(fixtures.LLAMA, 1, 1, 1, qk_l2_norm=True, qk_layernorm=True)
    values, _, _ = model_values(SavedArgs.of(args, "common.pt"))
    assert values["qk_l2_norm"] and not values["qk_layernorm"]
    cfg = tiny_config(**ROPE, qk_l2_norm=True)
    exported = megatron_args(
        cfg, MegatronLayout(1, 1, 1, "torch_dist"), iteration=1, consumed_samples=0, dtype="float32"
    )
    assert exported.qk_l2_norm and "--qk-l2-norm" in flags_to_pass(exported)  # read back equal, or refused
