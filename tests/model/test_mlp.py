"""The MLP's GELU is Megatron-LM's: the tanh approximation of its fused bias-GELU kernel for a
GELU MLP with biases (--bias-gelu-fusion, the default), exact erf GELU with
--no-bias-gelu-fusion or without biases; SwiGLU models have no GELU. The dense MLP and the MoE
experts (Megatron's SequentialMLP experts are its MLP) compute what ``gelu_approximation`` says,
checked against the formulas written out here."""

import pytest
import torch
import torch.nn.functional as F

from megatron_p2r.config import ModelConfig
from megatron_p2r.model.mlp import MLP
from megatron_p2r.moe.experts import Experts
from megatron_p2r.parallel.state import ParallelState

H, FFN = 8, 16
CASES = [  # (model options, the GELU Megatron-LM computes)
    ({}, "tanh"),  # biases + bias-GELU fusion
    ({"bias_gelu_fusion": False}, "none"),  # --no-bias-gelu-fusion
    ({"disable_bias_linear": True}, "none"),  # no bias to fuse: F.gelu
    ({"disable_bias_linear": True, "bias_gelu_fusion": False}, "none"),
    ({"swiglu": True}, "none"),  # no GELU at all
]


def _tanh_gelu(y):
    """Megatron-LM's fused_bias_gelu.bias_gelu (on y = fc1 output + bias)."""
    return y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


def _erf_gelu(y):
    return y * 0.5 * (1.0 + torch.erf(y / 2**0.5))


def _filled(module):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def _model(**options) -> ModelConfig:
    return ModelConfig(hidden_size=H, ffn_hidden_size=FFN, num_layers=2, **options)


@pytest.mark.parametrize("options,gelu", CASES)
def test_gelu_approximation_is_megatrons_rule(options, gelu):
    assert _model(**options).gelu_approximation == gelu


@pytest.mark.parametrize("options,gelu", [case for case in CASES if not case[0].get("swiglu")])
def test_dense_mlp_computes_that_gelu(options, gelu):
    mlp = _filled(MLP(_model(**options), ParallelState.single()))
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    y = F.linear(x, mlp.fc1.weight, mlp.fc1.bias)
    y = (_tanh_gelu if gelu == "tanh" else _erf_gelu)(y)
    torch.testing.assert_close(mlp(x), F.linear(y, mlp.fc2.weight, mlp.fc2.bias))


@pytest.mark.parametrize("options,gelu", [case for case in CASES if not case[0].get("swiglu")])
def test_experts_compute_that_gelu(options, gelu):
    experts = _filled(Experts(_model(num_experts=2, **options), ParallelState.single()))
    counts = [3, 5]
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(1))
    want = []
    for e, rows in enumerate(x.split(counts)):
        bias1, bias2 = (None, None) if experts.bias1 is None else (experts.bias1[e], experts.bias2[e])
        y = (_tanh_gelu if gelu == "tanh" else _erf_gelu)(F.linear(rows, experts.weight1[e], bias1))
        want.append(F.linear(y, experts.weight2[e], bias2))
    torch.testing.assert_close(experts(x, counts), torch.cat(want))
