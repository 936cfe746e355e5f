"""Rank arithmetic of layout/ranks.py, checked without processes for worlds 1..512."""

import pytest

from megatron_p2r.layout.ranks import GROUP_KINDS, Layout, stage_set_groups


@pytest.mark.parametrize(
    "world,tp,pp,ep", [(1, 1, 1, 1), (8, 2, 2, 1), (8, 2, 1, 2), (16, 2, 2, 2), (512, 8, 4, 4), (512, 1, 64, 8)]
)
def test_groups_partition_the_world_and_match_coordinates(world, tp, pp, ep):
    layout = Layout.from_world(world, tp, pp, ep)
    assert layout.world_size == world
    for rank in range(world):
        c = layout.coords(rank)
        assert layout.rank(c.tp, c.dp, c.pp) == rank
        assert c.ep == c.dp % ep and c.expert_dp == c.dp // ep
    for kind in GROUP_KINDS:
        groups = layout.groups(kind)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), kind  # a partition of the world
    expected_sizes = {"tp": tp, "dp": world // (tp * pp), "pp": pp, "ep": ep, "expert_dp": world // (tp * pp * ep)}
    for kind, size in expected_sizes.items():
        assert {len(g) for g in layout.groups(kind)} == {size}, kind
    for kind in GROUP_KINDS:  # group_of computes from coordinates what a search of groups finds
        for group in layout.groups(kind):
            for rank in group[:: max(1, len(group) // 3)]:
                assert layout.group_of(kind, rank) == group, (kind, rank)


def test_group_members_share_the_documented_coordinates():
    layout = Layout.from_world(16, tp=2, pp=2, ep=2)  # dp = 4
    same = {
        "tp": ("dp", "pp"),
        "dp": ("tp", "pp"),
        "pp": ("tp", "dp"),
        "ep": ("tp", "pp", "expert_dp"),
        "expert_dp": ("tp", "pp", "ep"),
    }
    for kind, fields in same.items():
        for group in layout.groups(kind):
            coords = [layout.coords(r) for r in group]
            for f in fields:
                assert len({getattr(c, f) for c in coords}) == 1, (kind, f, group)


def test_tp_neighbours_and_stage_order():
    layout = Layout.from_world(8, tp=2, pp=2)
    assert layout.groups("tp")[0] == [0, 1]
    assert layout.group_of("pp", 0) == [0, 4]
    assert layout.group_of("dp", 5) == [5, 7]


def test_stage_set_groups():
    layout = Layout.from_world(16, tp=2, pp=4, ep=1)  # dp = 2
    groups = stage_set_groups(layout, (0, 3), "dp")
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    for g in groups:
        coords = [layout.coords(r) for r in g]
        assert {c.pp for c in coords} == {0, 3} and len({c.tp for c in coords}) == 1


def test_invalid_layouts():
    with pytest.raises(ValueError, match="not divisible"):
        Layout.from_world(6, tp=4)
    with pytest.raises(ValueError, match="EP must divide DP"):
        Layout(tp=1, pp=1, dp=3, ep=2)
    with pytest.raises(ValueError, match="outside world"):
        Layout().coords(1)


@pytest.mark.parametrize("world,tp,pp,ep,cp", [(4, 1, 1, 1, 2), (16, 2, 2, 2, 2), (16, 1, 1, 4, 4), (512, 8, 4, 8, 4)])
def test_context_parallel_groups(world, tp, pp, ep, cp):
    """CP between TP and DP; the dp group (gradients, optimizer shards) holds the DP x CP replicas;
    EP divides DP x CP (Megatron's expert grid)."""
    layout = Layout.from_world(world, tp, pp, ep, cp)
    dp = world // (tp * pp * cp)
    for rank in range(world):
        c = layout.coords(rank)
        assert layout.rank(c.tp, c.dp, c.pp, c.cp) == rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert c.dp_cp == c.cp + cp * c.dp and (c.ep, c.expert_dp) == (c.dp_cp % ep, c.dp_cp // ep)
    sizes = {"tp": tp, "cp": cp, "dp": dp * cp, "pp": pp, "ep": ep, "expert_dp": dp * cp // ep}
    for kind in GROUP_KINDS:
        groups = layout.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert {len(g) for g in groups} == {sizes[kind]}, kind
        for group in groups:
            assert layout.group_of(kind, group[-1]) == group, kind
    for group in layout.groups("cp"):
        coords = [layout.coords(r) for r in group]
        assert len({(c.tp, c.dp, c.pp) for c in coords}) == 1 and [c.cp for c in coords] == list(range(cp))


def test_context_parallel_rank_order_is_megatrons():
    """TP 2 x CP 2 x DP 2 x PP 2 (and EP 2): the groups Megatron-LM's own RankGenerator makes
    (megatron/core/parallel_state.py, order tp-cp-ep-dp-pp; printed by it for this test): tp, cp,
    "dp-cp" (our dp kind: gradients and optimizer shards), pp; the expert grid's ep and dp."""
    layout = Layout.from_world(16, tp=2, pp=2, ep=2, cp=2)
    megatron = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "expert_dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    }
    for kind, groups in megatron.items():
        assert sorted(layout.groups(kind)) == groups, kind
