"""import-megatron on checkpoints written by Megatron-LM's own code (tests/fixtures/megatron,
made by make_fixtures.py with megatron-core 0.16.1): each imports with the CLI into TP=1 and
TP=2 and gives the logits Megatron computed on the same tokens (rel 1e-5). megatron-core is not
needed: the checkpoints and Megatron's logits are committed files."""
import os

import pytest
import torch

from megatron_p2r.testing import run_distributed
from tests.convert.megatron.megatron_written import FIXTURES, fixture_logits, logits_error, our_logits
from tools.convert_checkpoint import main

TARGETS = (1, 2)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{(fixture, target TP): our checkpoint}, each written by the CLI."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name in FIXTURES:
        for tp in TARGETS:
            dst = str(root / f"{name}_tp{tp}")
            assert main(["import-megatron", fixture_logits(name)[0], dst, "--target-tensor-parallel-size", str(tp),
                         "--no-progress"]) == 0, name
            out[(name, tp)] = dst
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_tp1_gives_megatrons_logits(imported, name):
    _, tokens, want = fixture_logits(name)
    abs_err, rel_err = logits_error(our_logits(imported[(name, 1)], tokens), want)
    assert rel_err <= 1e-5, (name, abs_err, rel_err)


def _tp2_errors(rank, world, runs):
    """(max abs, rel) per fixture: numbers, not tensors, cross the process boundary."""
    return {name: logits_error(our_logits(ckpt, fixture_logits(name)[1], world=world), fixture_logits(name)[2])
            for name, ckpt in runs.items()}


def test_tp2_gives_megatrons_logits(imported):
    """Every fixture's TP=2 import on 2 gloo ranks (one launch for all)."""
    runs = {name: imported[(name, 2)] for name in FIXTURES}
    for rank_errors in run_distributed(_tp2_errors, 2, runs, timeout=300):
        for name in FIXTURES:
            assert rank_errors[name][1] <= 1e-5, (name, rank_errors[name])


def test_the_fixtures_cover_megatrons_layouts():
    """Both formats, TP > 1, EP > 1, bf16 and MoE are among the committed fixtures."""
    kinds = {name: os.listdir(os.path.join(fixture_logits(name)[0], "iter_0000003")) for name in FIXTURES}
    assert any("common.pt" in files for files in kinds.values())
    assert any("mp_rank_01" in files for files in kinds.values())
    assert any("mp_rank_00_001" in files for files in kinds.values())
    assert {"gpt", "llama", "mixtral"} == {name.split("_")[0] for name in FIXTURES}
    assert any("bf16" in name for name in FIXTURES)
    assert torch.load(os.path.join(os.path.dirname(fixture_logits(FIXTURES[0])[0]), "logits.pt"),
                      weights_only=True)["logits"].dtype == torch.float32
