"""The tensor table that places every piece, and the file entries it gives for a layout."""

import json

from megatron_p2r.checkpoint.naming import entry_name
from megatron_p2r.checkpoint.tensor_table import ShardLayout, file_entries, tensor_table
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING
from tests.helpers import tiny_config


def _pieces(cfg):
    return {k: (v.shape, v.tp_dim, v.expert, v.layers) for k, v in tensor_table(cfg).items()}


def test_table_is_layout_invariant_and_stores_replicas_once():
    """Keys, global shapes and split dims do not depend on TP/PP; the tied output weight and a
    pseudo slot used on both stages are one piece, held by the first stage that has it."""
    base = tiny_config(num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2")
    other = tiny_config(
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        pipeline_layer_split="1,3",
    )
    assert _pieces(base) == _pieces(other)
    table = tensor_table(other)
    assert "output_layer.weight" not in table and table[WORD_EMBEDDING].stage == 0
    qkv = table["layers.1.attention.qkv.weight"]
    assert qkv.layers == (1, 3) and qkv.stage == 1 and qkv.tp_dim == 0 and qkv.shape == (96, 32)
    assert table["layers.0.attention.qkv.weight"].layers == (0, 2)
    assert table["layers.0.attention.qkv.weight"].stage == 0
    assert not [k for k in table if k.startswith(("layers.2.", "layers.3."))]


def test_file_entries_place_each_shard_exactly_once():
    cfg = tiny_config(
        num_layers=3,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        untie_embeddings_and_output_weights=True,
    )
    table, layout = tensor_table(cfg), ShardLayout.of(cfg)
    entries = file_entries(table, layout, ("model", "exp_avg"))
    assert sorted(entries) == sorted(layout.files()) and len(entries) == 4
    names = [e[0] for ents in entries.values() for e in ents]
    for info in table.values():
        for kind in ("model", "exp_avg"):
            assert names.count(entry_name(kind, info.key)) == (2 if info.tp_dim is not None else 1)
    local = {e[0]: e[2] for e in entries["mp_rank_01_001_000.safetensors"]}
    assert local["output_layer.weight"] == (table["output_layer.weight"].shape[0] // 2, 32)
    assert "final_norm.weight" not in local  # not split over TP: stored by TP rank 0 only
    json.dumps({k: v.to_json() for k, v in table.items()})  # metadata is plain JSON


def test_experts_are_pieces_under_their_global_index():
    cfg = tiny_config(
        num_layers=2, num_experts=4, moe_ffn_hidden_size=24, tensor_model_parallel_size=2, expert_model_parallel_size=2
    )
    table, layout = tensor_table(cfg), ShardLayout.of(cfg)
    w1 = [table[f"layers.1.mlp.experts.{e}.weight1"] for e in range(4)]
    assert [(i.expert, i.shape, i.tp_dim, i.param) for i in w1] == [
        (e, (24, 32), 0, "layers.1.mlp.experts.weight1") for e in range(4)
    ]
    assert table["layers.1.mlp.experts.2.weight2"].tp_dim == 1 and table["layers.1.mlp.experts.2.bias2"].tp_dim is None
    assert [layout.file_of(i, 1) for i in w1] == ["mp_rank_01_000_000.safetensors"] * 2 + [
        "mp_rank_01_000_001.safetensors"
    ] * 2
    assert tensor_table(tiny_config(num_layers=2, num_experts=4, moe_ffn_hidden_size=24)).keys() == table.keys()
