"""Stage partitioning, checked without processes: layer counts, flag errors, and what each
stage of the model holds (built on the meta device for every stage of a layout)."""
from __future__ import annotations

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError, stage_layer_counts, validate
from megatron_p2r.model.m6 import WORD_EMBEDDING, build_model, replica_stage_sets
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.pipeline.partition import stage_layer_ranges
from tests.helpers import tiny_config


@pytest.mark.parametrize("layers,pp,split,counts", [
    (4, 1, None, [4]), (4, 4, None, [1, 1, 1, 1]), (10, 4, None, [3, 3, 2, 2]), (7, 2, None, [4, 3]),
    (16, 4, "3,5,5,3", [3, 5, 5, 3]), (4, 2, "1,3", [1, 3])])
def test_stage_layer_counts(layers, pp, split, counts):
    assert stage_layer_counts(layers, pp, split) == counts
    ranges = stage_layer_ranges(layers, pp, split)
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, complete


@pytest.mark.parametrize("layers,pp,split,message", [
    (16, 4, "3,5,5", "has 3 entries but --pipeline-model-parallel-size is 4"),
    (16, 4, "3,5,5,4", "adds up to 17, but --num-layers is 16"),
    (16, 4, "3,0,8,5", "every stage needs at least one layer"),
    (16, 4, "3,5,x,3", "expected comma-separated integers"),
    (3, 4, None, r"--pipeline-model-parallel-size \(4\) exceeds --num-layers \(3\)")])
def test_bad_splits_are_clear_errors(layers, pp, split, message):
    with pytest.raises(ConfigError, match=message):
        stage_layer_counts(layers, pp, split)


def test_validate_checks_the_split_flag():
    cfg = parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,4",
                      "--vocab-size", "200", "--mock-data"])
    with pytest.raises(ConfigError, match="--pipeline-layer-split '3,4' adds up to 7"):
        validate(cfg, world_size=2)
    cfg = cfg.replace(pipeline_layer_split="3,5")
    validate(cfg, world_size=2)
    assert cfg.parallel.pipeline_schedule == "1f1b"  # the default
    with pytest.raises(SystemExit):
        parse_args(["--pipeline-schedule", "interleaved"])


def _stages(cfg, pp: int):
    return [build_model(cfg, ParallelState(layout=Layout(pp=pp), rank=s), meta=True) for s in range(pp)]


@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_their_layers_embedding_head_and_replicas(tied):
    cfg = tiny_config(num_layers=5, pipeline_model_parallel_size=3, pipeline_layer_split="2,2,1",
                      untie_embeddings_and_output_weights=not tied)
    first, middle, last = _stages(cfg, 3)
    assert [m.layer_keys for m in (first, middle, last)] == [[0, 1], [2, 3], [4]]
    assert first.embedding is not None and first.final_norm is None and first.output_layer is None
    assert middle.embedding is None and middle.final_norm is None and middle.output_layer is None
    assert last.embedding is None and last.final_norm is not None and last.output_layer is not None
    out_w, emb_w = last.output_layer.weight, first.embedding.word_embeddings.weight
    if tied:  # one logical tensor, held by stages 0 and 2, gradients summed there
        assert replica_stage_sets(cfg) == {WORD_EMBEDDING: (0, 2)}
        assert logical_name("output_layer.weight", out_w) == WORD_EMBEDDING
        assert out_w.shared_stages == emb_w.shared_stages == (0, 2)
        assert out_w.shape == emb_w.shape
    else:
        assert replica_stage_sets(cfg) == {}
        assert getattr(out_w, "shared_stages", None) is None and getattr(emb_w, "shared_stages", None) is None
    # Together the stages hold exactly the one-stage model's logical tensors.
    single = build_model(tiny_config(num_layers=5, untie_embeddings_and_output_weights=not tied),
                         ParallelState.single(), meta=True)
    held = [logical_name(n, p) for m in (first, middle, last) for n, p in m.named_parameters()]
    replicas = 1 if tied else 0
    assert len(held) == len(set(held)) + replicas
    assert set(held) == {n for n, _ in single.named_parameters()}
