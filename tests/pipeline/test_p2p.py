"""Point-to-point between stages: one message per tensor (the receiver allocates from the
shape both ends know), both directions, right peers under data parallelism, and sends never
wait for the receiver."""

from __future__ import annotations

import pytest
import torch

from megatron_p2r.parallel.state import Layout, ParallelState
from megatron_p2r.pipeline.order import BACKWARD, FORWARD, Message
from megatron_p2r.pipeline.p2p import StageLink
from megatron_p2r.pipeline.transfers import Transfers
from tests.pipeline.common import SHAPES

HIDDEN = 32  # tests.helpers.TINY
NOTHING = Transfers({}, {}, frozenset())


def test_send_checks_the_spec():
    """A stage that produced something other than what its peer allocates fails before sending."""
    link = StageLink(ParallelState(layout=Layout(pp=2), rank=0), NOTHING, lambda msg: ((2, 3), torch.bfloat16))
    with pytest.raises(
        RuntimeError,
        match=r"activation to send forward \(micro-batch 0, virtual stage 1\) is "
        r"torch.float32 \(2, 3\), but the peer stage allocates torch.bfloat16",
    ):
        link.send(Message(FORWARD, 0, 1), torch.zeros(2, 3), 1)
    link = StageLink(ParallelState(layout=Layout(pp=2), rank=1), NOTHING, lambda msg: ((3, 2), torch.float32))
    with pytest.raises(
        RuntimeError,
        match=r"gradient to send backward \(micro-batch 4, virtual stage 0\) is "
        r"torch.float32 \(2, 3\), but the peer stage allocates "
        r"torch.float32 \(3, 2\)",
    ):
        link.send(Message(BACKWARD, 4, 0), torch.zeros(2, 3), 0)


def test_a_message_the_peer_never_sends_fails_instead_of_hanging():
    link = StageLink(
        ParallelState(layout=Layout(pp=2), rank=1),
        Transfers({0: []}, {}, frozenset()),
        lambda msg: ((2,), torch.float32),
    )
    with pytest.raises(
        RuntimeError,
        match=r"pipeline rank 1 waits for .* from pipeline rank 0, whose schedule "
        r"does not send it",
    ):
        link.recv(Message(FORWARD, 0, 1), 0)


def test_send_recv_between_stages(world4):
    """PP=4 (middle stages send and receive both ways) and PP=2 x DP=2 (peers keep their dp):
    every stage first sends 6 tensors of varying shape and dtype forward and backward, then
    receives (the forward ones last first); each must arrive intact from the right peer."""
    for r in world4:
        for key in ("p2p/pp4", "p2p/pp2dp2"):
            assert r[key] == {"ok": True}, (r["rank"], key, r[key])


@pytest.mark.parametrize("shapes", ["fixed", "varying"])
def test_one_message_per_activation_and_gradient(world4, shapes):
    """A 1F1B step of 3 micro-batches on PP=4, every isend/recv counted: stage s sends each
    micro-batch's activation forward (s < 3) and its gradient backward (s > 0) and receives
    the same from its peers -- nothing else, with fixed or varying micro-batch shapes (a shape
    header per tensor would double the count)."""
    batch_shapes = [SHAPES[0]] * 3 if shapes == "fixed" else SHAPES
    for r in world4:
        m = r["messages"][shapes]
        s = m["stage"]
        hidden = [(b, t, HIDDEN) for b, t in batch_shapes]
        want = sorted(hidden * ((s < 3) + (s > 0)))
        assert sorted(m["sent"]) == want, (s, m)
        assert sorted(m["received"]) == want, (s, m)


def test_overlapped_p2p_posts_every_receive_but_the_first_ahead(world4):
    """Interleaved 1F1B on PP=4, m=6, with --overlap-p2p-communication: the same messages as
    without it, but each op's receives are posted (irecv) while the op before it computes, so
    only a stage's first op may receive blocking."""
    for r in world4:
        serial, overlapped = r["messages"]["interleaved"], r["messages"]["overlapped"]
        assert serial["posted"] == [] and sorted(overlapped["sent"]) == sorted(serial["sent"]), overlapped
        assert sorted(overlapped["received"] + overlapped["posted"]) == sorted(serial["received"]), overlapped
        assert len(overlapped["received"]) == (1 if overlapped["stage"] > 0 else 0), overlapped
