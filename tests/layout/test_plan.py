"""The ParallelPlan, checked without processes: stage ranges, module keys, replicas, reductions,
the norm's owners, the offload choice, and that the model built from it is what it says."""

from __future__ import annotations

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError, stage_layer_counts, validate
from megatron_p2r.layout.plan import ParallelPlan, Reduction, stage_layer_ranges
from megatron_p2r.layout.ranks import Layout
from megatron_p2r.layout.tensor_specs import WORD_EMBEDDING
from megatron_p2r.model.m6 import build_model
from megatron_p2r.parallel.sharding import logical_name
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "layers,pp,split,counts",
    [
        (4, 1, None, [4]),
        (4, 4, None, [1, 1, 1, 1]),
        (10, 4, None, [3, 3, 2, 2]),
        (7, 2, None, [4, 3]),
        (16, 4, "3,5,5,3", [3, 5, 5, 3]),
        (4, 2, "1,3", [1, 3]),
    ],
)
def test_stage_layer_counts(layers, pp, split, counts):
    assert stage_layer_counts(layers, pp, split) == counts
    ranges = stage_layer_ranges(layers, pp, split)
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, complete


@pytest.mark.parametrize(
    "layers,pp,split,message",
    [
        (16, 4, "3,5,5", "has 3 entries but --pipeline-model-parallel-size is 4"),
        (16, 4, "3,5,5,4", "adds up to 17, but --num-layers is 16"),
        (16, 4, "3,0,8,5", "every stage needs at least one layer"),
        (16, 4, "3,5,x,3", "expected comma-separated integers"),
        (3, 4, None, r"--pipeline-model-parallel-size \(4\) exceeds --num-layers \(3\)"),
    ],
)
def test_bad_splits_are_clear_errors(layers, pp, split, message):
    with pytest.raises(ConfigError, match=message):
        stage_layer_counts(layers, pp, split)


def test_validate_checks_the_split_flag():
    cfg = parse_args(
        [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-layer-split",
            "3,4",
            "--vocab-size",
            "200",
            "--mock-data",
        ]
    )
    with pytest.raises(ConfigError, match="--pipeline-layer-split '3,4' adds up to 7"):
        validate(cfg, world_size=2)
    with pytest.raises(SystemExit):
        parse_args(["--pipeline-schedule", "interleaved"])


def _plan(world: int = 1, **kw) -> ParallelPlan:
    return ParallelPlan.for_world(tiny_config(**kw), world)


def test_pseudo_slots_on_several_stages_are_replicas_reduced_over_those_stages_and_dp():
    plan = _plan(8, num_layers=8, pipeline_model_parallel_size=4, p2r_phase="pseudo", share_pattern="cycle:2")
    assert [st.layer_keys for st in plan.stages] == [(0, 1)] * 4
    assert [st.modules for st in plan.stages] == [(0, 1)] * 4
    assert plan.replica_stages("layers.1.mlp.fc1.weight") == (0, 1, 2, 3)
    assert plan.reduction("layers.1.mlp.fc1.weight", False) == Reduction("sharing", "dp", (0, 1, 2, 3))
    assert plan.reduction(WORD_EMBEDDING, False) == Reduction("embedding", "dp", (0, 3))
    assert plan.reduction("final_norm.weight", False) == Reduction("dp", "dp")
    assert plan.stage_sets() == ((0, 1, 2, 3), (0, 3))


def test_block_sharing_keeps_each_slot_on_one_stage_and_real_phase_shares_nothing():
    block = _plan(
        2,
        num_layers=4,
        pipeline_model_parallel_size=2,
        p2r_phase="pseudo",
        share_pattern="block:2",
        untie_embeddings_and_output_weights=True,
    )
    assert [st.layer_keys for st in block.stages] == [(0, 0), (2, 2)]
    assert block.replicas == () and block.stage_sets() == ()
    real = _plan(2, num_layers=4, pipeline_model_parallel_size=2, p2r_phase="real", share_pattern="all")
    assert real.share_pattern == "none" and real.layer_keys == (0, 1, 2, 3)
    assert real.replicas == ((WORD_EMBEDDING, (0, 1)),)


def test_experts_reduce_over_expert_dp():
    plan = _plan(4, num_experts=4, expert_model_parallel_size=2, global_batch_size=8)
    assert plan.reduction("layers.1.mlp.experts.weight1", True) == Reduction("expert_dp", "expert_dp")


def test_each_logical_element_counts_once_in_the_norm():
    """Over every rank of a TP2 x PP2 x DP2 layout, each (tensor, TP slice) is counted once."""
    cfg = tiny_config(
        num_layers=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        global_batch_size=8,
        num_experts=4,
        moe_layer_freq=2,
        expert_model_parallel_size=2,
    )
    plan = ParallelPlan.for_world(cfg, 8)
    counted = {}
    for rank in range(8):
        c = plan.layout.coords(rank)
        for s in plan.tensors(c.pp):
            if plan.counts_in_norm(s.logical, s.tp_dim, s.expert, c):
                key = (s.logical, c.tp if s.tp_dim is not None else None, c.ep if s.expert else None)
                counted[key] = counted.get(key, 0) + 1
    assert set(counted.values()) == {1}
    logical = {s.logical for st in range(2) for s in plan.tensors(st)}
    assert {k[0] for k in counted} == logical


def test_offload_choice_is_made_per_stage_in_the_plan():
    plan = _plan(2, num_layers=6, pipeline_model_parallel_size=2, cpu_offload_layers="1")
    assert [st.offloaded for st in plan.stages] == [(2,), (5,)]
    listed = _plan(2, num_layers=6, pipeline_model_parallel_size=2, cpu_offload_layers="0,4")
    assert [st.offloaded for st in listed.stages] == [(0,), (4,)]
    pseudo = _plan(1, num_layers=4, p2r_phase="pseudo", share_pattern="cycle:2", cpu_offload_layers="1")
    assert pseudo.stage(0).offloaded == (1,)  # slot 1 serves layers 1 and 3: offloaded once


@pytest.mark.parametrize("tied", [True, False])
def test_model_stages_hold_what_the_plan_says(tied):
    cfg = tiny_config(
        num_layers=5,
        pipeline_model_parallel_size=3,
        pipeline_layer_split="2,2,1",
        untie_embeddings_and_output_weights=not tied,
    )
    plan = ParallelPlan.build(cfg, Layout(pp=3))
    stages = [build_model(cfg, ParallelState(layout=Layout(pp=3), rank=s), plan, meta=True) for s in range(3)]
    first, middle, last = stages
    assert [m.layer_keys for m in stages] == [[0, 1], [2, 3], [4]]
    assert first.embedding is not None and first.final_norm is None and first.output_layer is None
    assert middle.embedding is None and middle.final_norm is None and middle.output_layer is None
    assert last.embedding is None and last.final_norm is not None and last.output_layer is not None
    for s, model in enumerate(stages):  # names, local shapes and sharding: the plan's tensor specs
        built = [
            (n, tuple(p.shape), getattr(p, "tp_dim", None), getattr(p, "shared_name", None))
            for n, p in model.named_parameters()
        ]
        assert built == [(t.name, t.shape, t.tp_dim, t.shared_name) for t in plan.tensors(s)]
    out_w = last.output_layer.weight
    if tied:  # one logical tensor, held by stages 0 and 2, gradients summed there
        assert plan.replicas == ((WORD_EMBEDDING, (0, 2)),)
        assert logical_name("output_layer.weight", out_w) == WORD_EMBEDDING
    else:
        assert plan.replicas == ()
    # Together the stages hold exactly the one-stage model's logical tensors.
    single = build_model(
        tiny_config(num_layers=5, untie_embeddings_and_output_weights=not tied), ParallelState.single(), meta=True
    )
    held = [logical_name(n, p) for m in stages for n, p in m.named_parameters()]
    assert len(held) == len(set(held)) + (1 if tied else 0)
    assert set(held) == {n for n, _ in single.named_parameters()}


# ----------------------------------------------------------------------------- virtual stages


def test_virtual_stages_follow_megatron():
    """--num-layers-per-virtual-pipeline-stage N: v = (L/P)/N chunks per rank, chunk c of rank p
    is virtual stage c*P + p with layers [(cP+p)N, (cP+p+1)N); --num-virtual-stages-per-pipeline-rank
    gives the same plan; N = L/P is no interleaving."""
    plan = _plan(2, num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    assert plan.num_model_chunks == 2
    assert [[list(c.layers) for c in st.chunks] for st in plan.stages] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [[c.index for c in st.chunks] for st in plan.stages] == [[0, 2], [1, 3]]
    assert [c.index for c in plan.virtual_stages] == [0, 1, 2, 3]
    assert plan.stages[0].layers == (0, 1, 4, 5) and plan.stages[1].layer_keys == (2, 3, 6, 7)
    assert [(st.first, st.last) for st in plan.stages] == [(True, False), (False, True)]
    assert [(c.first, c.last) for c in plan.virtual_stages] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    same = _plan(2, num_layers=8, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2)
    assert same.stages == plan.stages
    assert (
        _plan(2, num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=4).num_model_chunks
        == 1
    )


def test_virtual_stage_replicas_are_pipeline_ranks():
    """A slot called by two chunks of one rank is one module there (no replica); across ranks it
    joins the cross-stage group of those pipeline ranks; the tied embedding joins rank 0's first
    chunk and rank P-1's last."""
    vpp = dict(
        num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, p2r_phase="pseudo"
    )
    cycle = _plan(2, share_pattern="cycle:2", **vpp)  # layers 0, 2 (slot 0) on rank 0; 1, 3 on rank 1
    assert [st.modules for st in cycle.stages] == [(0,), (1,)]
    assert cycle.replicas == ((WORD_EMBEDDING, (0, 1)),)
    every = _plan(2, share_pattern="all", **vpp)
    assert [st.layer_keys for st in every.stages] == [(0, 0), (0, 0)]
    assert [st.modules for st in every.stages] == [(0,), (0,)]
    assert every.reduction("layers.0.mlp.fc1.weight", False) == Reduction("sharing", "dp", (0, 1))
    assert every.stage_sets() == ((0, 1),)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(num_layers_per_virtual_pipeline_stage=1, num_virtual_stages_per_pipeline_rank=2), "pass at most one"),
        (dict(num_layers_per_virtual_pipeline_stage=3), "must divide the 4 layers of each pipeline stage"),
        (dict(num_virtual_stages_per_pipeline_rank=3), "must divide the 4 layers of each pipeline stage"),
        (
            dict(num_layers_per_virtual_pipeline_stage=1, pipeline_layer_split="3,5"),
            "cannot be combined with --pipeline-layer-split",
        ),
        (dict(num_layers_per_virtual_pipeline_stage=1, pipeline_schedule="gpipe"), "interleaving is a 1F1B schedule"),
        (
            dict(num_layers_per_virtual_pipeline_stage=1, pipeline_model_parallel_size=1),
            "needs --pipeline-model-parallel-size > 1",
        ),
        (dict(num_virtual_stages_per_pipeline_rank=2, num_layers=6), "must divide the 3 layers of each pipeline stage"),
        (dict(num_virtual_stages_per_pipeline_rank=2, num_layers=7), r"needs --num-layers \(7\) divisible by"),
    ],
)
def test_bad_interleaving_flags_are_clear_errors(flags, message):
    cfg = tiny_config(**{"num_layers": 8, "pipeline_model_parallel_size": 2, **flags})
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=cfg.parallel.pipeline_model_parallel_size)


def test_interleaved_model_holds_what_the_plan_says():
    """Each rank builds one module per key its chunks call, names and shapes from the plan's table."""
    cfg = tiny_config(num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    plan = ParallelPlan.build(cfg, Layout(pp=2))
    for s in range(2):
        model = build_model(cfg, ParallelState(layout=Layout(pp=2), rank=s), plan, meta=True)
        assert model.num_model_chunks == 2 and model.layer_keys == [s, s + 2]
        built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        assert built == [(t.name, t.shape) for t in plan.tensors(s)]


def test_a_parameter_is_final_in_the_lowest_chunk_that_uses_it():
    """Overlapped reduction starts a bucket when its parameters are final: backward runs the
    chunks in reverse, so a module is final in the lowest chunk that calls it — a pseudo slot
    called by both chunks of a rank in chunk 0, not in the chunk that runs first."""
    vpp = dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    real = _plan(2, **vpp)
    first, last = real.stage(0), real.stage(1)
    keys = {k: c.chunk for c in first.chunks for k in c.layer_keys}
    assert {k: first.final_chunk("layers.%d.mlp.fc1.weight" % k, k) for k in keys} == keys == {0: 0, 1: 0, 4: 1, 5: 1}
    assert first.final_chunk("embedding.word_embeddings.weight", None) == 0
    assert last.final_chunk("final_norm.weight", None) == 1
    pseudo = _plan(2, p2r_phase="pseudo", share_pattern="all", **vpp).stage(0)
    assert [c.layer_keys for c in pseudo.chunks] == [(0, 0), (0, 0)]
    assert pseudo.final_chunk("layers.0.mlp.fc1.weight", 0) == 0
    cycle = _plan(2, p2r_phase="pseudo", share_pattern="cycle:4", **vpp).stage(1)
    assert [c.layer_keys for c in cycle.chunks] == [(2, 3), (2, 3)] and cycle.final_chunk("x", 3) == 0


def test_context_parallel_replicas_reduce_and_shard_over_dp_x_cp():
    """CP2 x DP2: every parameter's replicas are the 4 DP x CP ranks: its gradient buffer's group
    has 4 members, the distributed optimizer cuts it in 4 shards, one rank's copy counts in the norm."""
    cfg = tiny_config(context_parallel_size=2, global_batch_size=4, use_distributed_optimizer=True)
    plan = ParallelPlan.for_world(cfg, 4)
    assert (plan.layout.cp, plan.layout.dp, plan.layout.dp_cp) == (2, 2, 4)
    (buf,) = plan.grad_buffers(0)
    assert buf.over == "dp" and buf.members == 4 and buf.sharded
    members = sorted(plan.buffer_member(buf, plan.layout.coords(r)) for r in range(4))
    assert members == [0, 1, 2, 3]
    spec = plan.tensors(0)[0]
    counted = [r for r in range(4) if plan.counts_in_norm(spec.logical, None, False, plan.layout.coords(r))]
    assert counted == [0]
