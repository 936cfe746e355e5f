"""--apply-wd-to-qk-layernorm (megatron-core's Qwen3-Next grouping): the query/key norms join the
weight-decay group; every other norm and bias keeps none, as without the flag."""

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.model.m6 import build_model
from megatron_p2r.optim.optimizer import param_groups
from megatron_p2r.parallel.state import ParallelState

BASE = [
    "--mock-data",
    "--vocab-size",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--qk-layernorm",
    "--weight-decay",
    "0.1",
]


def _decayed(argv):
    cfg = parse_args(BASE + argv)
    model = build_model(cfg, ParallelState.single())
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: group["weight_decay"] for group in param_groups(model, cfg.train) for p in group["params"]}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_norms_decay_only_with_the_flag(normalization):
    plain = _decayed(["--normalization", normalization])
    flagged = _decayed(["--normalization", normalization, "--apply-wd-to-qk-layernorm"])
    qk = {name for name in plain if "q_layernorm." in name or "k_layernorm." in name}
    assert qk and all(plain[name] == 0.0 for name in qk)
    assert all(flagged[name] == 0.1 for name in qk)
    assert {name: wd for name, wd in flagged.items() if name not in qk} == {
        name: wd for name, wd in plain.items() if name not in qk
    }
    assert any(wd == 0.0 for name, wd in flagged.items() if name not in qk)  # other norms keep none
