"""Progressive delinking (all -> cycle:K -> none as a chain of delinks) and relative noise."""

import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert
from megatron_p2r.config import ConfigError
from megatron_p2r.p2r import delink as dl
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_datasets, evaluate
from tests.checkpoint.common import metadata
from tests.helpers import run_steps, tiny_config

CHAIN = dict(
    num_layers=4,
    train_iters=8,
    eval_iters=2,
    global_batch_size=4,
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    weight_decay=0.01,
    clip_grad=1.0,
    device="cpu",
    log_interval=100,
)


def _eval(state) -> float:
    _, valid = build_datasets(state.cfg, state.ps)
    return evaluate(state, valid)


def _phase(pattern: str) -> dict:
    return (
        dict(CHAIN, p2r_phase="real") if pattern == "none" else dict(CHAIN, p2r_phase="pseudo", share_pattern=pattern)
    )


def test_chain_all_cycle2_none_preserves_eval_loss_at_each_link(tmp_path):
    """Train under all, delink to cycle:2, train, delink to none, train: at each link the eval
    loss of the delinked model equals the source's (same layout: bitwise), and training goes on."""
    _, state = run_steps(tiny_config(**_phase("all")), ParallelState.single(), 2)
    before = _eval(state)
    save_checkpoint(str(tmp_path / "all"), state)
    for i, pattern in enumerate(["cycle:2", "none"]):
        convert(
            str(tmp_path / ("all" if i == 0 else "trained0")),
            str(tmp_path / f"link{i}"),
            Target(),
            DelinkOptions(share_pattern=pattern),
            progress=False,
        )
        losses, state = run_steps(
            tiny_config(**_phase(pattern)), ParallelState.single(), 0, load=str(tmp_path / f"link{i}")
        )
        assert _eval(state) == before, pattern
        assert state.iteration == 2 + 2 * i
        losses, state = run_steps(
            tiny_config(**_phase(pattern)), ParallelState.single(), 2, load=str(tmp_path / f"link{i}")
        )
        before = _eval(state)
        save_checkpoint(str(tmp_path / f"trained{i}"), state)
    meta = metadata(str(tmp_path / "link1" / "iter_0000004"))
    assert meta["p2r"]["layer_module_keys"] == [0, 1, 2, 3]
    assert [h["share_pattern"] for h in metadata(str(tmp_path / "link0" / "iter_0000002"))["history"]] == ["cycle:2"]


def test_finer_pseudo_pattern_moments_and_tensors(tmp_path):
    """all over 4 layers -> cycle:2: modules 0 and 1 each take 2 of the slot's 4 uses, so
    'rescale' multiplies the first moment by 2/4 and the second by (2/4)^2."""
    _, state = run_steps(tiny_config(**_phase("all")), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "all"), state)
    convert(
        str(tmp_path / "all"), str(tmp_path / "cycle"), Target(), DelinkOptions(share_pattern="cycle:2"), progress=False
    )
    _, cyc = run_steps(tiny_config(**_phase("cycle:2")), ParallelState.single(), 0, load=str(tmp_path / "cycle"))
    src = dict(state.model.named_parameters())
    for name, q in cyc.model.named_parameters():
        p = src[dl.source_key(name, [0, 0, 0, 0])]
        assert torch.equal(q, p), name
        if name.startswith("layers."):
            assert torch.equal(cyc.optimizer.state[q]["exp_avg"], state.optimizer.state[p]["exp_avg"] * 2 / 4)
            assert torch.equal(cyc.optimizer.state[q]["exp_avg_sq"], state.optimizer.state[p]["exp_avg_sq"] * 4 / 16)
    assert {n.split(".")[1] for n, _ in cyc.model.named_parameters() if n.startswith("layers.")} == {"0", "1"}


def test_target_pattern_must_refine_the_source(tmp_path):
    _, state = run_steps(tiny_config(**_phase("cycle:2")), ParallelState.single(), 1)
    save_checkpoint(str(tmp_path / "cycle"), state)
    with pytest.raises(
        ConfigError,
        match=r"--target-share-pattern block:2: layers 0 and 1 share a module in the "
        r"target but come from different modules of the source \(cycle:2\)",
    ):
        convert(
            str(tmp_path / "cycle"),
            str(tmp_path / "block"),
            Target(),
            DelinkOptions(share_pattern="block:2"),
            progress=False,
        )
    with pytest.raises(ConfigError, match="--target-share-pattern 'cycle:9': K must be between 1 and --num-layers"):
        convert(
            str(tmp_path / "cycle"),
            str(tmp_path / "bad"),
            Target(),
            DelinkOptions(share_pattern="cycle:9"),
            progress=False,
        )
    convert(str(tmp_path / "cycle"), str(tmp_path / "real"), Target(), DelinkOptions(), progress=False)
    with pytest.raises(CheckpointError, match="p2r.phase is 'real'; delink needs a pseudo-phase checkpoint"):
        convert(
            str(tmp_path / "real"),
            str(tmp_path / "again"),
            Target(),
            DelinkOptions(share_pattern="cycle:2"),
            progress=False,
        )


def test_relative_noise_follows_each_tensors_std():
    w = torch.randn(300, 300) * 0.5
    noisy = dl.add_noise(w, "layers.1.mlp.fc1.weight", 0.1, seed=3, relative=True)
    assert abs((noisy - w).std().item() - 0.1 * w.std().item()) < 0.002
    ones = torch.ones(64)  # a norm weight at its initial value: no spread, no noise
    assert torch.equal(dl.add_noise(ones, "layers.1.input_norm.weight", 0.1, seed=3, relative=True), ones)
    assert torch.equal(dl.add_noise(torch.ones(1), "x", 0.1, seed=3, relative=True), torch.ones(1))
