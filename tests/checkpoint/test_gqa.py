"""Checkpoints of grouped-query attention models: the recorded row layouts, TP splits of the
query/key-value pieces including TP > groups (key/value heads stored once per replica block),
bitwise reshard round trips, and eval-loss preservation through reshard and delink.

Tolerance: fp32 eval losses rel 1e-5 (a change of layout changes only the order of reductions).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.metadata import write_metadata
from megatron_p2r.convert.reshard import DelinkOptions, Target, convert, target_config
from megatron_p2r.checkpoint.tensor_table import ShardLayout, tensor_table
from megatron_p2r.config import ConfigError
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.checkpoint.common import metadata, same_bytes, shard_files
from tests.helpers import run_steps, tiny_config

GQA = dict(
    group_query_attention=True,
    num_query_groups=2,
    qk_layernorm=True,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    add_qkv_bias=True,
    num_layers=4,
    global_batch_size=8,
    eval_iters=2,
    device="cpu",
    log_interval=100,
)
KV = "layers.1.attention.key_value.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa") / "a"
    _, state = run_steps(tiny_config(**GQA), ParallelState.single(), 2)
    save_checkpoint(str(root), state)
    return root


def test_table_records_row_layouts():
    table = tensor_table(tiny_config(**GQA))
    assert table["layers.0.attention.query.weight"].rows.to_json() == {"groups": 4, "per_group": ["q"], "head_dim": 8}
    assert table[KV].rows.to_json() == {"groups": 2, "per_group": ["k", "v"], "head_dim": 8}
    assert table[KV].shape == (32, 32) and table["layers.0.attention.q_layernorm.weight"].rows is None
    fused = tensor_table(tiny_config())["layers.0.attention.qkv.weight"]
    assert fused.rows.to_json() == {"groups": 4, "per_group": ["q", "k", "v"], "head_dim": 8}
    tp4 = ShardLayout.of(tiny_config(**GQA, tensor_model_parallel_size=4))
    assert list(tp4.tp_ranks_of(table[KV])) == [0, 2] and tp4.local_shape(table[KV]) == (16, 32)
    assert tp4.file_of(table[KV], 3) == "mp_rank_02_000_000.safetensors"


def test_round_trip_with_replicated_key_value_heads_is_bitwise(source, tmp_path):
    """TP1 -> TP4 x PP2 (each key/value head on 2 TP ranks, stored by the first) -> TP2 -> TP1:
    the shard comes back byte-identical; on the way every TP4 file holds exactly its slice."""
    b, c, a2 = tmp_path / "b", tmp_path / "c", tmp_path / "a2"
    convert(str(source), str(b), Target(4, 2), progress=False)
    convert(str(b), str(c), Target(2, 1), progress=False)
    convert(str(c), str(a2), Target(1, 1), progress=False)
    full = load_file(str(source / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    for t in range(4):
        part = load_file(str(b / "iter_0000002" / f"mp_rank_0{t}_000_000.safetensors"))
        assert torch.equal(
            part["layers.0.attention.query.weight"], full["layers.0.attention.query.weight"][8 * t : 8 * t + 8]
        )
        assert ("layers.0.attention.key_value.weight" in part) == (t in (0, 2))  # one copy per replica block
        if t in (0, 2):
            for name in (
                "layers.0.attention.key_value.weight",
                "layers.0.attention.key_value.bias",
                "optimizer.exp_avg.layers.0.attention.key_value.weight",
            ):
                assert torch.equal(part[name], full[name][8 * t : 8 * t + 16]), (t, name)
        assert ("layers.0.attention.q_layernorm.weight" in part) == (t == 0)
    src_file, back = (
        source / "iter_0000002" / "mp_rank_00_000_000.safetensors",
        a2 / "iter_0000002" / "mp_rank_00_000_000.safetensors",
    )
    assert shard_files(str(a2 / "iter_0000002")) == ["mp_rank_00_000_000.safetensors"]
    assert same_bytes(src_file, back)
    assert metadata(str(b / "iter_0000002"))["tensors"][KV]["rows"] == {
        "groups": 2,
        "per_group": ["k", "v"],
        "head_dim": 8,
    }


def test_reshard_refuses_tp_that_splits_groups_and_a_changed_layout(source, tmp_path):
    """TP 6 over 4 groups (12 heads) neither divides nor is divided by them; a table whose
    recorded rows differ from the model's is refused, naming the field."""
    twelve = tiny_config(
        **dict(GQA, num_query_groups=4), num_attention_heads=12, hidden_size=48, make_vocab_size_divisible_by=48
    )
    with pytest.raises(ConfigError, match="--target-tensor-parallel-size 6 and the model's --num-query-groups"):
        target_config(twelve, Target(6), delink=False)
    path = source / "iter_0000002" / "metadata.json"
    original = path.read_text()
    try:
        meta = json.loads(original)
        meta["tensors"][KV]["rows"]["per_group"] = ["v", "k"]
        write_metadata(str(path.parent), meta)
        with pytest.raises(CheckpointError, match=f"tensors\\['{KV}'\\].rows is"):
            convert(str(source), str(tmp_path / "y"), Target(2), progress=False)
    finally:
        path.write_text(original)


# ----------------------------------------------------------------------------- across layouts


def _across_layouts(rank, world, root):
    """Train a real model under TP4 (2 groups: replicated over 2 ranks each) and a pseudo one
    under TP2 x PP2 (1 group: replicated over both TP ranks), saving both; reshard / delink
    them into other layouts; evaluate every copy on these 4 ranks."""
    import torch.distributed as dist
    from megatron_p2r.training import pretrain

    real = dict(GQA, tensor_model_parallel_size=4)
    pseudo = dict(
        GQA,
        num_query_groups=1,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
    )
    paths = {n: os.path.join(root, n) for n in ("real", "pseudo", "tp1", "tp2", "delink_tp4", "delink_tp1pp2")}
    pretrain(tiny_config(**real, train_iters=2, save=paths["real"]))
    pretrain(tiny_config(**pseudo, train_iters=2, save=paths["pseudo"]))
    if rank == 0:
        convert(paths["real"], paths["tp1"], Target(1, 1), progress=False)
        convert(paths["real"], paths["tp2"], Target(2, 2), progress=False)
        convert(paths["pseudo"], paths["delink_tp4"], Target(4, 1), DelinkOptions(), progress=False)
        convert(paths["pseudo"], paths["delink_tp1pp2"], Target(1, 2), DelinkOptions(), progress=False)
    dist.barrier()
    as_real = dict(pseudo, p2r_phase="real")
    runs = {
        "real": real,
        "tp1": dict(real, tensor_model_parallel_size=1),
        "tp2": dict(real, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        "pseudo": pseudo,
        "delink_tp4": dict(as_real, tensor_model_parallel_size=4, pipeline_model_parallel_size=1),
        "delink_tp1pp2": dict(as_real, tensor_model_parallel_size=1),
    }
    return {
        name: pretrain(tiny_config(**values, load=paths[name], eval_only=True))["eval_loss"]
        for name, values in runs.items()
    }


def test_reshard_and_delink_preserve_the_eval_loss(tmp_path):
    losses = run_distributed(_across_layouts, 4, str(tmp_path), timeout=600)[0]
    for name in ("tp1", "tp2"):
        assert losses[name] == pytest.approx(losses["real"], rel=1e-5), name
    for name in ("delink_tp4", "delink_tp1pp2"):
        assert losses[name] == pytest.approx(losses["pseudo"], rel=1e-5), name
