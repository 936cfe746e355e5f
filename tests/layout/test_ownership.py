"""Checkpoint ownership, without processes: each logical tensor stored once by its first stage
and the first TP rank of each shard's replicas, and the writers a fully parallel save assigns
balanced by bytes within each file. The checkpoint's tensor table and the planner read these;
tests/planning/test_checkpoint_cost.py checks the planner's bytes against a real save."""

from megatron_p2r.layout.ownership import WrittenPiece, assign_writers, stored_tensors, storing_tp_ranks
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING
from tests.helpers import tiny_config


def test_replicas_on_later_stages_are_not_stored_again():
    cfg = tiny_config(
        num_layers=4,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        pipeline_layer_split="1,3",
    )
    stored = {st.logical: st for st in stored_tensors(ParallelPlan.model_parallel(cfg))}
    assert len(stored) == len(stored_tensors(ParallelPlan.model_parallel(cfg)))
    # the tied output weight is the word embedding's replica; slot 1 is first called on stage 1
    assert "output_layer.weight" not in stored and stored[WORD_EMBEDDING].stage == 0
    assert stored["layers.0.attention.qkv.weight"].stage == 0
    assert stored["layers.1.attention.qkv.weight"].stage == 1
    qkv = stored["layers.1.attention.qkv.weight"]
    assert qkv.spec.shape == (48, 32) and qkv.piece_shape(2) == (96, 32) and qkv.tp_ranks(2) == range(2)


def test_replicated_key_value_heads_are_stored_by_the_first_of_their_holders():
    """TP 4 over 2 key/value groups: ranks 0-1 hold group 0, ranks 2-3 group 1."""
    cfg = tiny_config(group_query_attention=True, num_query_groups=2, tensor_model_parallel_size=4)
    stored = {st.logical: st for st in stored_tensors(ParallelPlan.model_parallel(cfg))}
    kv = stored["layers.0.attention.key_value.weight"]
    assert kv.tp_ranks(4) == range(0, 4, 2) and kv.piece_shape(4)[0] == 2 * kv.spec.shape[0]
    assert storing_tp_ranks(4, None) == range(1)


def test_experts_are_pieces_of_one_expert():
    cfg = tiny_config(
        num_layers=2, num_experts=4, moe_ffn_hidden_size=24, expert_model_parallel_size=2, tensor_model_parallel_size=2
    )
    experts = [st for st in stored_tensors(ParallelPlan.model_parallel(cfg)) if st.spec.expert]
    assert experts
    for st in experts:
        assert st.spec.shape[0] == 2 and len(st.piece_shape(2)) == len(st.spec.shape) - 1


def test_writers_balance_bytes_within_each_file():
    pieces = [
        WrittenPiece("a", 0, 0, False, 100),
        WrittenPiece("b", 0, 0, False, 10),
        WrittenPiece("c", 0, 0, False, 10),
        WrittenPiece("d", 1, 0, False, 5),  # another file: its replicas start empty
        WrittenPiece("e", 0, 0, True, 7),  # experts: over the expert-data-parallel replicas
        WrittenPiece("g", 0, 1, True, 7),  # another EP rank's file
        WrittenPiece("f", 0, 0, True, 7),
    ]
    assert assign_writers(pieces, dp=2, expert_dp=2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0, "f": 1, "g": 0}
    assert set(assign_writers(pieces, dp=4, expert_dp=1).values()) <= {0, 1, 2}
    assert assign_writers(pieces, dp=4, expert_dp=1)["f"] == 0
