"""Gradient buffers, buckets and distributed-optimizer shards as pure layout (layout/buckets.py)
and as the ParallelPlan exposes them: no processes, any rank of any layout."""

import math

import pytest

from megatron_p2r.layout.buckets import BUCKET_ALIGN, PARAM_ALIGN, default_bucket_size, layout_buffer
from megatron_p2r.layout.plan import ParallelPlan
from megatron_p2r.layout.ranks import Layout, stage_set_groups
from tests.helpers import tiny_config

NUMELS = [700, 50, 3000, 10, 129, 64, 1, 900]
MODULES = [0, 0, 0, 1, 1, 1, None, None]


def _buffer(members=4, sharded=True, bucket_size=1000, breaks=False):
    names = [f"p{i}" for i in range(len(NUMELS))]
    return layout_buffer("dp", (), 1, members, sharded, names, NUMELS, MODULES, bucket_size, breaks)


def test_megatron_bucket_size_rule():
    assert default_bucket_size(48, overlap_grad_reduce=False, requested=1234) is None  # one bucket
    assert default_bucket_size(8, overlap_grad_reduce=True, requested=None) == 40_000_000
    assert default_bucket_size(64, overlap_grad_reduce=True, requested=None) == 64_000_000
    assert default_bucket_size(64, overlap_grad_reduce=True, requested=1234) == 1234


@pytest.mark.parametrize(
    "members,sharded,bucket_size,breaks",
    [
        (4, True, 1000, False),
        (3, True, None, False),
        (4, False, 1000, False),
        (2, True, 100, True),
        (1, False, None, True),
        (48, True, 2000, False),
    ],
)
def test_buckets_hold_whole_parameters_and_shards_partition_them(members, sharded, bucket_size, breaks):
    buf = _buffer(members, sharded, bucket_size, breaks)
    covered = [0] * len(NUMELS)
    for b, bucket in enumerate(buf.buckets):
        assert bucket.params and bucket.start < bucket.end
        for i in bucket.params:  # a parameter lies inside its bucket, never across two
            lo, hi = buf.ranges[i]
            assert bucket.start <= lo < hi <= bucket.end and hi - lo == NUMELS[i]
        if sharded:  # Megatron's padding: equal shards, 64-aligned starts
            assert (bucket.end - bucket.start) % math.lcm(members, BUCKET_ALIGN) == 0
            assert all(buf.ranges[i][0] % PARAM_ALIGN == 0 for i in bucket.params)
        if bucket_size is not None and b < len(buf.buckets) - 1 and not breaks:
            last = buf.ranges[bucket.params[-1]][1]  # closed by the parameter that reached the size
            assert last - bucket.start >= bucket_size > buf.ranges[bucket.params[-1]][0] - bucket.start
        if breaks:
            assert len({buf.modules[i] for i in bucket.params}) == 1
        shards = [buf.shard(b, m) for m in range(members)]
        if sharded:
            assert shards[0][0] == bucket.start and shards[-1][1] == bucket.end
            assert all(shards[m][1] == shards[m + 1][0] for m in range(members - 1))
    for i in range(len(NUMELS)):
        shards = buf.param_shards(i)
        owners = [m for m, _, _ in shards]
        if sharded:  # every element of the parameter has exactly one owner
            assert sorted(owners) == owners and len(set(owners)) == len(owners)
            assert [p[1] for p in shards][0] == 0 and shards[-1][2] == NUMELS[i]
            assert all(shards[k][2] == shards[k + 1][1] for k in range(len(shards) - 1))
        else:  # replicated optimizer: every member owns it whole
            assert shards == [(m, 0, NUMELS[i]) for m in range(members)]
        for m, start, end in shards:
            covered[i] += end - start
    assert covered == [n * (1 if sharded else members) for n in NUMELS]
    for m in range(members):
        assert buf.owned(m) == [(i, s, e) for i in range(len(NUMELS)) for mm, s, e in buf.param_shards(i) if mm == m]
    assert sum(buf.footprints()) == buf.numel


def test_unsharded_buffer_is_unpadded_and_one_bucket_without_a_size():
    buf = _buffer(4, sharded=False, bucket_size=None)
    assert len(buf.buckets) == 1 and buf.numel == sum(NUMELS)
    assert buf.ranges[0] == (0, 700) and buf.ranges[-1] == (sum(NUMELS) - 900, sum(NUMELS))


def _cfg(**kw):
    return tiny_config(**{"num_layers": 4, **kw})


def test_plan_buffers_follow_reductions_in_reverse_order():
    cfg = _cfg(
        pipeline_model_parallel_size=2, p2r_phase="pseudo", share_pattern="cycle:2", use_distributed_optimizer=True
    )
    plan = ParallelPlan.for_world(cfg, 8)  # TP1 PP2 DP4
    for stage in (0, 1):
        tensors = [s.name for s in plan.tensors(stage)]
        bufs = {(b.over, b.stages): b for b in plan.grad_buffers(stage)}
        assert set(bufs) == {("dp", ()), ("dp", (0, 1))}
        local = bufs[("dp", ())]
        assert list(local.names) == [n for n in reversed(tensors) if n in local.names]
        assert local.members == 4 and local.sharded
        cross = bufs[("dp", (0, 1))]
        assert cross.members == 8 and cross.sharded  # the slots and the tied embedding over 2 stages x DP 4


@pytest.mark.parametrize(
    "kw",
    [
        dict(share_pattern="cycle:2"),
        # stage 1 first uses the MoE slot (layer 3), stage 0 the dense one: their local orders differ
        dict(num_layers=6, share_pattern="all", num_experts=4, moe_layer_freq=2, moe_ffn_hidden_size=24),
    ],
)
def test_a_cross_stage_group_is_laid_out_identically_on_its_stages(kw):
    """Every member reduces the same elements at the same offsets (the collectives line up)."""
    plan = ParallelPlan.for_world(
        _cfg(
            **{
                "pipeline_model_parallel_size": 2,
                "p2r_phase": "pseudo",
                "use_distributed_optimizer": True,
                "overlap_grad_reduce": True,
                "ddp_bucket_size": 500,
                **kw,
            }
        ),
        4,
    )
    a, b = (next(x for x in plan.grad_buffers(s) if x.stages) for s in (0, 1))
    logical = {"output_layer.weight": "embedding.word_embeddings.weight"}
    assert [logical.get(n, n) for n in a.names] == [logical.get(n, n) for n in b.names]
    assert a.ranges == b.ranges and a.buckets == b.buckets and len(a.buckets) > 1


@pytest.mark.parametrize("layout", [Layout(dp=4), Layout(tp=2, pp=2, dp=4, ep=2), Layout(pp=3, dp=2)])
def test_buffer_member_is_the_process_group_rank(layout):
    """The plan's member index of a rank equals its position in the (sorted) rank list the
    process group is created from: shards computed without processes are the ones the
    collectives deliver."""
    cfg = _cfg(
        num_layers=6,
        pipeline_model_parallel_size=layout.pp,
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        p2r_phase="pseudo",
        share_pattern="cycle:2",
        use_distributed_optimizer=True,
        **({"num_experts": 4, "moe_ffn_hidden_size": 24} if layout.ep > 1 else {}),
    )
    plan = ParallelPlan.build(cfg, layout)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        for buf in plan.grad_buffers(c.pp):
            if buf.stages:
                group = next(g for g in stage_set_groups(layout, buf.stages, buf.over) if rank in g)
            else:
                group = layout.group_of(buf.over, rank)
            assert len(group) == buf.members
            assert group.index(rank) == plan.buffer_member(buf, c), (rank, buf.over, buf.stages)


def test_plan_names_the_owner_of_every_range():
    cfg = _cfg(use_distributed_optimizer=True)
    plan = ParallelPlan.for_world(cfg, 4)
    name = "layers.0.mlp.fc1.weight"
    shards = plan.optimizer_shards(0, name)
    numel = next(s.numel for s in plan.tensors(0) if s.name == name)
    assert shards[0][1] == 0 and shards[-1][2] == numel and all(0 <= m < 4 for m, _, _ in shards)
    assert sum(e - s for _, s, e in shards) == numel
    replicated = ParallelPlan.for_world(_cfg(), 4).optimizer_shards(0, name)
    assert replicated == [(m, 0, numel) for m in range(4)]
    with pytest.raises(KeyError):
        plan.optimizer_shards(0, "nope")


def test_a_shard_counts_in_the_norm_on_its_owner_only_once_over_tp():
    plan = ParallelPlan.for_world(_cfg(tensor_model_parallel_size=2, use_distributed_optimizer=True), 4)
    c = plan.layout.coords(3)  # tp 1, dp 1
    assert not plan.counts_in_norm("layers.0.input_norm.weight", None, False, c)  # DP replica
    assert plan.counts_in_norm("layers.0.mlp.fc1.weight", 0, False, c, sharded=True)  # its own shard
    assert not plan.counts_in_norm("layers.0.input_norm.weight", None, False, c, sharded=True)  # TP replica
