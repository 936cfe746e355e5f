"""The planner's pipeline transfers with --overlap-p2p-communication: a rank posts each op's
receives while the op before it computes, so a step waits only for the part of a transfer that
outlasts that op (``planning.estimate.exposed_p2p``); as in Megatron-LM, only interleaved 1F1B
overlaps. (The runtime's overlap: tests/pipeline/test_schedules.py and test_p2p.py.)"""

from __future__ import annotations

import pytest

from megatron_p2r.arguments import config_from_values
from megatron_p2r.planning import estimate, hardware

GPU = hardware.GPU_PRESETS["A100-80GB"]
PIPELINE = dict(
    num_layers=8,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=1000,
    micro_batch_size=1,
    global_batch_size=16,
    mock_data=True,
    bf16=True,
    pipeline_model_parallel_size=4,
)


def plans(**kw):
    """(plan without, plan with --overlap-p2p-communication) on 8 GPUs."""
    return tuple(
        estimate.make_plan(config_from_values({**PIPELINE, **kw, "overlap_p2p_communication": on}), 8, GPU)
        for on in (False, True)
    )


def test_exposed_p2p_is_what_outlasts_the_op_it_travels_under():
    """Half the transfers travel under a forward (1/3 of the compute), half under a backward (2/3)."""
    assert estimate.exposed_p2p(1.0, 3.0) == 0.0  # 0.5 under 1 and 0.5 under 2: hidden
    assert estimate.exposed_p2p(4.0, 3.0) == pytest.approx(1.0)  # 2 under a forward of 1: 1 exposed
    assert estimate.exposed_p2p(6.0, 3.0) == pytest.approx(3.0)  # 3 - 1 and 3 - 2
    assert estimate.exposed_p2p(0.0, 3.0) == 0.0


def test_overlap_hides_the_transfers_of_the_interleaved_schedule():
    off, on = plans(num_layers_per_virtual_pipeline_stage=1)
    slots = off.microbatches * (1 + off.pipeline_bubble)
    hidden = []
    for before, after in zip(off.stages, on.stages, strict=True):
        t = before.time_s
        assert "pp_hidden_per_microbatch" not in t and t["pp_per_microbatch"] > 0
        window = t["compute_per_microbatch"] + t["tp_per_microbatch"] + t["ep_per_microbatch"]
        expected = t["pp_per_microbatch"] - estimate.exposed_p2p(t["pp_per_microbatch"], window)
        assert after.time_s["pp_hidden_per_microbatch"] == pytest.approx(expected)
        assert {k: v for k, v in after.time_s.items() if k != "pp_hidden_per_microbatch"} == t
        hidden.append(expected)
    saved = off.step_breakdown_s["pipeline"] - on.step_breakdown_s["pipeline"]
    assert 0 < saved <= slots * max(hidden) * (1 + 1e-9)
    assert on.step_time_s < off.step_time_s


def test_overlap_holds_the_posted_receive_buffers_one_op_longer():
    """The planner's device memory counts the receives posted ahead (``transfers.link_buffers``)."""
    off, on = plans(num_layers_per_virtual_pipeline_stage=1)
    grown = [after.device_total - before.device_total for before, after in zip(off.stages, on.stages, strict=True)]
    assert min(grown) >= 0 and max(grown) > 0, grown


def test_overlap_changes_nothing_without_interleaving():
    off, on = plans()
    assert on.step_time_s == off.step_time_s
    assert [s.time_s for s in on.stages] == [s.time_s for s in off.stages]
