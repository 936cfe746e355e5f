"""Resharding: bitwise round trips, eval-loss preservation, safety checks, bounded memory."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.integrity import verify
from megatron_p2r.checkpoint.metadata import metadata_config, metadata_table, read_metadata
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import Target, _layer_map, _plan, convert
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.sharding import expert_key, logical_name
from megatron_p2r.parallel.state import Layout, ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import build_train_state
from tests.checkpoint.common import metadata, same_bytes, shard_files, streaming_rss_growth
from tests.helpers import run_steps, tiny_config

MODEL = dict(
    num_layers=4,
    untie_embeddings_and_output_weights=True,
    global_batch_size=4,
    eval_iters=2,
    device="cpu",
    log_interval=100,
)
MOE = dict(MODEL, num_experts=4, moe_layer_freq=2, moe_ffn_hidden_size=24)


def _save(root, model):
    _, state = run_steps(tiny_config(**model), ParallelState.single(), 2)
    save_checkpoint(str(root), state)
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("reshard") / "a", MODEL)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("reshard") / "moe", MOE)


def _expected_entries(global_tensors: dict, model: dict, layout: Layout, split, t: int, s: int, e: int) -> dict:
    """Entry name -> what file (tp t, stage s, ep e) of ``layout`` may hold: cut here from the
    one-file source's global tensors, along each parameter's tp_dim as the model built for
    that rank declares it (not the checkpoint's own table), with ``narrow``."""
    cfg = tiny_config(
        **model,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        pipeline_layer_split=split,
        expert_model_parallel_size=layout.ep,
    )
    stage = build_model(cfg, ParallelState(layout=layout, rank=layout.rank(t, e, s)), meta=True)
    out = {}
    for name, param in stage.named_parameters():
        logical, tp_dim = logical_name(name, param), getattr(param, "tp_dim", None)
        if getattr(param, "expert", False):  # stacked [local experts, ...]: pieces per global expert
            n = param.shape[0]
            pieces = {expert_key(logical, x): None if tp_dim is None else tp_dim - 1 for x in range(e * n, (e + 1) * n)}
        else:
            pieces = {logical: tp_dim}
        for key, dim in pieces.items():
            for entry in [key] + [f"optimizer.{kind}.{key}" for kind in ("exp_avg", "exp_avg_sq", "step")]:
                full = global_tensors[entry]
                if dim is None or entry.startswith("optimizer.step."):
                    out[entry] = full
                else:
                    size = full.shape[dim] // layout.tp
                    out[entry] = full.narrow(dim, t * size, size)
    return out


def _check_shards_against_global(src_iter, out_iter, model: dict, layout: Layout, split) -> set:
    """Every tensor of every shard of ``out_iter`` equals its independently cut slice of the
    source's global tensor; returns the split dims met (so the check cannot be vacuous)."""
    global_tensors = load_file(os.path.join(src_iter, "mp_rank_00_000_000.safetensors"))
    dims = set()
    for name in shard_files(str(out_iter)):
        if not name.startswith("mp_rank"):
            continue
        t, s, e = (int(x) for x in name.split(".")[0].split("_")[2:])
        expected = _expected_entries(global_tensors, model, layout, split, t, s, e)
        for entry, tensor in load_file(os.path.join(out_iter, name)).items():
            assert entry in expected, f"{name}: {entry} is not a tensor of tp {t} stage {s} ep {e}"
            same = torch.equal(tensor, expected[entry])
            assert same, f"{name}: {entry} is not its slice of the global tensor"
            full = global_tensors[entry]
            dims.update(d for d in range(full.dim()) if tensor.shape[d] != full.shape[d])
    return dims


@pytest.mark.parametrize("moe", [False, True])
def test_round_trip_is_bitwise(source, moe_source, tmp_path, moe):
    """A (TP1 PP1 EP1) -> TP2 PP2 split 1,3 (EP2) -> TP4 PP1 (EP4) -> A: every shard
    byte-identical to the original training save; metadata equal but for the history and the
    RNG files. MoE experts move between EP files under their global index. On the way, every
    tensor of B and C equals its slice of the global tensor cut independently (a split along
    the wrong dimension both ways would still round-trip)."""
    src = moe_source if moe else source
    ep = (lambda n: n) if moe else (lambda n: None)
    b, c, a2 = tmp_path / "b", tmp_path / "c", tmp_path / "a2"
    convert(str(src), str(b), Target(2, 2, "1,3", ep(2)), progress=False)
    convert(str(b), str(c), Target(4, 1, None, ep(4)), progress=False)
    convert(str(c), str(a2), Target(1, 1, None, ep(1)), progress=False)
    model = MOE if moe else MODEL
    dims = _check_shards_against_global(
        src / "iter_0000002", b / "iter_0000002", model, Layout(tp=2, pp=2, dp=ep(2) or 1, ep=ep(2) or 1), "1,3"
    )
    dims |= _check_shards_against_global(
        src / "iter_0000002", c / "iter_0000002", model, Layout(tp=4, dp=ep(4) or 1, ep=ep(4) or 1), None
    )
    assert dims == {0, 1}  # column- and row-parallel splits both met
    mb = metadata(str(b / "iter_0000002"))
    assert mb["layout"] == {"tp": 2, "pp": 2, "ep": 2 if moe else 1, "stage_layers": [[0, 1], [1, 4]]}
    assert len([f for f in shard_files(str(b / "iter_0000002")) if f.startswith("mp_rank")]) == (8 if moe else 4)
    if moe:  # expert 3 of layer 3 (stage 1) lives in EP rank 1's files, split over TP
        from megatron_p2r.checkpoint.safetensors_io import ShardReader

        for tp in (0, 1):
            names = ShardReader(str(b / "iter_0000002" / f"mp_rank_0{tp}_001_001.safetensors")).names()
            assert "layers.2.mlp.experts.3.weight1" in names and "layers.2.mlp.experts.1.weight1" not in names
    a_iter, a2_iter = src / "iter_0000002", a2 / "iter_0000002"
    shards = [f for f in shard_files(str(a_iter)) if f.startswith("mp_rank")]
    assert shards == shard_files(str(a2_iter)) == ["mp_rank_00_000_000.safetensors"]
    assert same_bytes(a_iter / shards[0], a2_iter / shards[0])
    ma, ma2 = metadata(str(a_iter)), metadata(str(a2_iter))
    assert [h["op"] for h in ma2.pop("history")] == ["reshard"] * 3 and ma.pop("history") == []
    assert ma2.pop("rng") is None and ma.pop("rng")["world_size"] == 1
    ma["crc32"] = {f: sums for f, sums in ma["crc32"].items() if not f.startswith("rng_and_data/")}
    ma.pop("metadata_crc32"), ma2.pop("metadata_crc32")  # each file's own: they differ where history and rng do
    assert ma == ma2


def _evaluate(rank, world, cases):
    from megatron_p2r.training import pretrain

    return {
        name: pretrain(tiny_config(**model, load=path, eval_only=True))["eval_loss"]
        for name, (path, model) in cases.items()
    }


def test_reshard_preserves_eval_loss(source, moe_source, tmp_path):
    """The same eval set on 2 ranks: TP1 x DP2 from the original, TP2 and PP2 from resharded
    copies; MoE: EP1 vs EP2 (fp32, rel 1e-5: only the order of reductions changes)."""
    convert(str(source), str(tmp_path / "tp2"), Target(tensor_parallel_size=2), progress=False)
    convert(str(source), str(tmp_path / "pp2"), Target(pipeline_parallel_size=2), progress=False)
    convert(str(moe_source), str(tmp_path / "ep2"), Target(expert_parallel_size=2), progress=False)
    cases = {
        "tp1": (str(source), MODEL),
        "tp2": (str(tmp_path / "tp2"), dict(MODEL, tensor_model_parallel_size=2)),
        "pp2": (str(tmp_path / "pp2"), dict(MODEL, pipeline_model_parallel_size=2)),
        "moe ep1": (str(moe_source), MOE),
        "moe ep2": (str(tmp_path / "ep2"), dict(MOE, expert_model_parallel_size=2)),
    }
    losses = run_distributed(_evaluate, 2, cases)[0]
    assert losses["tp2"] == pytest.approx(losses["tp1"], rel=1e-5)
    assert losses["pp2"] == pytest.approx(losses["tp1"], rel=1e-5)
    assert losses["moe ep2"] == pytest.approx(losses["moe ep1"], rel=1e-5)


def test_destination_rules_and_bad_source(source, tmp_path):
    dst = tmp_path / "d"
    dst.mkdir()
    (dst / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --force"):
        convert(str(source), str(dst), Target(2), progress=False)
    assert (dst / "x").read_text() == "keep me"
    convert(str(source), str(dst), Target(2), force=True, progress=False)
    assert sorted(os.listdir(dst)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    with pytest.raises(CheckpointError, match="overlaps SRC"):
        convert(str(source), str(source / "inside"), Target(2), progress=False)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    os.remove(broken / "iter_0000002" / "mp_rank_00_000_000.safetensors")
    with pytest.raises(CheckpointError, match="missing shard .*mp_rank_00_000_000.safetensors"):
        convert(str(broken), str(tmp_path / "out"), Target(2), progress=False)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.tmp")
    with pytest.raises(Exception, match="--target-tensor-parallel-size 3 does not divide"):
        convert(str(source), str(tmp_path / "out"), Target(3), progress=False)


def test_never_drops_or_invents_a_tensor(source, tmp_path):
    it = str(source / "iter_0000002")
    meta = read_metadata(it)
    table = metadata_table(meta)
    layer_map = _layer_map(meta, metadata_config(meta), metadata_config(meta), None)  # reshard: identity
    extra = dict(table)  # a source piece the target would not write (an expert lost by a converter)
    extra["layers.0.mlp.experts.9.weight1"] = table["layers.0.mlp.fc1.weight"]
    with pytest.raises(CheckpointError, match="'layers.0.mlp.experts.9.weight1' would be written 0 times"):
        _plan(extra, table, layer_map, it)
    missing = {k: v for k, v in table.items() if k != "final_norm.weight"}
    with pytest.raises(CheckpointError, match="needs 'final_norm.weight' from source tensor 'final_norm.weight'"):
        _plan(missing, table, layer_map, it)
    verify(it, meta, sum(i.numel for i in table.values()))  # a training save passes the same check
    with pytest.raises(CheckpointError, match="refusing to publish"):
        verify(it, meta, sum(i.numel for i in table.values()) + 1)


def test_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """8 layers of hidden 256 with AdamW moments (~75 MiB): the streaming loop (measured in a
    subprocess as peak RSS over its starting RSS) stays under 12 MiB + 4x the largest tensor
    (1 MiB) -- it holds one tensor's shards at a time, not the checkpoint (a loop that kept the
    tensors grew by ~100 MiB). The constant covers allocator noise (8.1 MiB seen in one CI run)."""
    cfg = tiny_config(num_layers=8, hidden_size=256, vocab_size=1000)
    state = build_train_state(cfg, ParallelState.single())
    for p in state.params:
        p.grad = torch.zeros_like(p)
    state.optimizer.step()  # creates the moments
    save_checkpoint(str(tmp_path / "big"), state)
    table = metadata_table(read_metadata(str(tmp_path / "big" / "iter_0000000")))
    largest = max(i.nbytes for i in table.values())
    total = sum(
        os.path.getsize(tmp_path / "big" / "iter_0000000" / f)
        for f in shard_files(str(tmp_path / "big" / "iter_0000000"))
    )
    bound = 12 * 2**20 + 4 * largest
    assert total > 4 * bound  # the checkpoint is many times the bound
    growth = streaming_rss_growth(
        "megatron_p2r.convert.reshard",
        "_write_tensors",
        f"from megatron_p2r.convert import reshard; reshard.convert("
        f"{str(tmp_path / 'big')!r}, {str(tmp_path / 'out')!r}, reshard.Target(2, 2), "
        "progress=False)",
    )
    assert growth < bound, f"streaming grew RSS by {growth / 2**20:.1f} MiB"
