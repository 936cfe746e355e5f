"""Depth growth: layer maps, the streamed converter across layouts, and the grown model's loss
against a model built by hand."""

import os

import pytest
import torch

from megatron_p2r.checkpoint.io import load_checkpoint, save_checkpoint
from megatron_p2r.checkpoint.metadata import metadata_config, metadata_table, read_metadata
from megatron_p2r.checkpoint.naming import resolve_iteration_dir
from megatron_p2r.convert.pieces import read_global
from megatron_p2r.convert.reshard import GrowOptions, Target, convert
from megatron_p2r.checkpoint.safetensors_io import ReaderCache
from megatron_p2r.checkpoint.tensor_table import ShardLayout
from megatron_p2r.config import ConfigError
from megatron_p2r.p2r import grow as gr
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import build_datasets, build_train_state, evaluate
from tests.helpers import run_steps, tiny_config
from tools.convert_checkpoint import main as convert_cli

SMALL = dict(
    num_layers=2,
    train_iters=3,
    eval_iters=2,
    global_batch_size=4,
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    weight_decay=0.01,
    clip_grad=1.0,
    device="cpu",
    log_interval=100,
)
KINDS = ("model", "exp_avg", "exp_avg_sq", "step")


def test_layer_maps():
    assert gr.grown_layers(3, 6, "stack") == [0, 1, 2, 0, 1, 2]  # G_stack: the whole model, k times
    assert gr.grown_layers(3, 6, "interleave") == [0, 0, 1, 1, 2, 2]
    assert gr.grown_layers(2, 8, "stack") == [0, 1, 0, 1, 0, 1, 0, 1]
    for bad in (5, 3, 2):
        with pytest.raises(ConfigError, match=f"--num-layers {bad} must be a multiple k >= 2 of the source's 3"):
            gr.grown_layers(3, bad, "stack")
    with pytest.raises(ConfigError, match="--method must be one of"):
        gr.grown_layers(3, 6, "copy")
    moe2 = [False, True]  # MoE in every other layer
    gr.check_layer_kinds(gr.grown_layers(2, 4, "stack"), moe2, moe2 * 2, "stack")
    with pytest.raises(ConfigError, match="target layer 1 is MoE but its source layer 0 is dense"):
        gr.check_layer_kinds(gr.grown_layers(2, 4, "interleave"), moe2, moe2 * 2, "interleave")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-layer real model after 2 steps, saved on one process and resharded to TP2 x PP2."""
    root = tmp_path_factory.mktemp("grow")
    _, state = run_steps(tiny_config(**SMALL), ParallelState.single(), 2)
    save_checkpoint(str(root / "one"), state)
    convert(str(root / "one"), str(root / "tp2pp2"), Target(2, 2), progress=False)
    return root, state


def _global(path: str):
    """(config, {(key, kind): global tensor}) of every piece of a checkpoint, in any layout."""
    iter_dir = resolve_iteration_dir(path)
    meta = read_metadata(iter_dir)
    cfg = metadata_config(meta)
    layout, readers = ShardLayout.of(cfg), ReaderCache(iter_dir)
    kinds = KINDS if meta["optimizer"] else ("model",)
    return cfg, {
        (k, kind): read_global(readers, layout, info, kind)
        for k, info in metadata_table(meta).items()
        for kind in kinds
    }


@pytest.mark.parametrize("method", ["stack", "interleave"])
def test_grow_tp2pp2_into_tp1pp4_copies_every_layer(source, tmp_path, method):
    root, _ = source
    out = convert(
        str(root / "tp2pp2"),
        str(tmp_path / "grown"),
        Target(1, 4),
        GrowOptions(num_layers=4, method=method, optimizer_state="copy"),
        progress=False,
    )
    src_cfg, src = _global(str(root / "tp2pp2"))
    cfg, dst = _global(str(tmp_path / "grown"))
    assert (src_cfg.parallel.tensor_model_parallel_size, src_cfg.parallel.pipeline_model_parallel_size) == (2, 2)
    layout = ShardLayout.of(cfg)
    assert (layout.tp, layout.pp, cfg.model.num_layers, cfg.p2r.p2r_phase) == (1, 4, 4, "real")
    sources = {"stack": [0, 1, 0, 1], "interleave": [0, 0, 1, 1]}[method]  # written out, not grow.py's
    layers_seen = set()
    for (key, kind), tensor in dst.items():
        parts = key.split(".", 2)
        skey = f"layers.{sources[int(parts[1])]}.{parts[2]}" if parts[0] == "layers" else key
        assert torch.equal(tensor, src[(skey, kind)]), (key, kind)
        layers_seen.add(parts[1] if parts[0] == "layers" else None)
    assert layers_seen == {"0", "1", "2", "3", None}
    assert len(dst) == len(src) + 2 * 4 * 12  # 2 more layers of 12 tensors, each in 4 kinds
    meta = read_metadata(out)
    assert meta["history"][-1]["op"] == "grow" and meta["history"][-1]["method"] == method
    assert (meta["iteration"], meta["consumed_samples"]) == (2, 8) and meta["rng"] is None


def _hand_built(state, num_layers: int, sources):
    """A ``num_layers`` real model whose layer j is a copy of ``state``'s layer sources[j], made
    with load_state_dict on parameter names, not with the converter."""
    cfg = state.cfg.replace(num_layers=num_layers)
    grown = build_train_state(cfg, ParallelState.single())
    small = state.model.state_dict()
    wanted = {}
    for name in grown.model.state_dict():
        parts = name.split(".", 2)
        wanted[name] = small[f"layers.{sources[int(parts[1])]}.{parts[2]}" if parts[0] == "layers" else name]
    grown.model.load_state_dict(wanted)
    _, valid = build_datasets(cfg, grown.ps)
    return evaluate(grown, valid)


def test_stack_grown_model_evaluates_like_a_model_built_by_hand(source, tmp_path):
    """One process, the same layout as the reference: bitwise; the loss also moved (growth is
    not function-preserving), and the CLI says so."""
    root, state = source
    assert (
        convert_cli(
            [
                "grow",
                str(root / "tp2pp2"),
                str(tmp_path / "grown"),
                "--num-layers",
                "4",
                "--target-tensor-parallel-size",
                "1",
                "--target-pipeline-parallel-size",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    grown = build_train_state(tiny_config(**{**SMALL, "num_layers": 4}), ParallelState.single())
    load_checkpoint(str(tmp_path / "grown"), grown)
    _, valid = build_datasets(grown.cfg, grown.ps)
    expected = _hand_built(state, 4, [0, 1, 0, 1])
    assert evaluate(grown, valid) == expected
    _, small_valid = build_datasets(state.cfg, state.ps)
    assert abs(expected - evaluate(state, small_valid)) > 1e-3


def test_grow_note_on_the_command_line(source, tmp_path, capsys):
    root, _ = source
    assert (
        convert_cli(
            [
                "grow",
                str(root / "one"),
                str(tmp_path / "g"),
                "--num-layers",
                "4",
                "--method",
                "interleave",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "growth is not function-preserving" in capsys.readouterr().out
    assert convert_cli(["grow", str(root / "one"), str(tmp_path / "bad"), "--num-layers", "3", "--no-progress"]) == 2
    assert "--num-layers 3 must be a multiple k >= 2 of the source's 2 layers" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad") and not os.path.exists(tmp_path / "bad.tmp")


def test_grow_a_pseudo_model_gives_identical_layers(tmp_path):
    """A pseudo model (share-pattern all over 2 layers) grown to 4 real layers: every layer is
    the one slot; optimizer 'rescale' divides the slot's moments by its 2 uses."""
    _, state = run_steps(tiny_config(**SMALL, p2r_phase="pseudo", share_pattern="all"), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "pseudo"), state)
    convert(
        str(tmp_path / "pseudo"),
        str(tmp_path / "grown"),
        Target(),
        GrowOptions(num_layers=4, method="stack"),
        progress=False,
    )
    _, src = _global(str(tmp_path / "pseudo"))
    _, dst = _global(str(tmp_path / "grown"))
    for j in range(4):
        w = f"layers.{j}.mlp.fc1.weight"
        assert torch.equal(dst[(w, "model")], src[("layers.0.mlp.fc1.weight", "model")])
        assert torch.equal(dst[(w, "exp_avg")], src[("layers.0.mlp.fc1.weight", "exp_avg")] / 2)
        assert torch.equal(dst[(w, "exp_avg_sq")], src[("layers.0.mlp.fc1.weight", "exp_avg_sq")] / 4)


def _eval_tp1pp4(rank, world, path):
    from megatron_p2r.training import pretrain

    return pretrain(
        tiny_config(**{**SMALL, "num_layers": 4, "pipeline_model_parallel_size": 4}, load=path, eval_only=True)
    )["eval_loss"]


def test_grown_tp1pp4_eval_matches_the_hand_built_reference(source, tmp_path):
    """The grown TP1 x PP4 checkpoint, evaluated on 4 pipeline ranks, against the one-process
    model built by hand: the same up to fp32 rounding of the changed reduction order (rel 1e-5)."""
    root, state = source
    convert(str(root / "tp2pp2"), str(tmp_path / "grown"), Target(1, 4), GrowOptions(num_layers=4), progress=False)
    losses = run_distributed(_eval_tp1pp4, 4, str(tmp_path / "grown"))
    expected = _hand_built(state, 4, [0, 1, 0, 1])
    assert losses == pytest.approx([expected] * 4, rel=1e-5)
