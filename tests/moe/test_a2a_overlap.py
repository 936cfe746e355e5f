"""--overlap-moe-expert-parallel-comm (pipeline/a2a_overlap.py) reproduces the serial schedule
bitwise under EP=2 (2 gloo ranks, 3 micro-batches per rank, 2 optimizer steps): losses, the
first step's reduced gradients and the weights after the steps; dropless and capacity with
drops, --overlap-grad-reduce with several buckets, tied embeddings and the pseudo phase's shared
layers (weights read by several nodes), fp16 weights with the loss scale, dense layers between
MoE ones, selective recomputation;
and TP=2 x EP=2 with sequence parallelism (4 ranks). And the all-to-alls do overlap: two are in flight at once. The flag's rules are
checked on the config (pipeline parallelism: tests/moe/test_a2a_pipelined.py)."""
from __future__ import annotations

import pytest

from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from megatron_p2r.testing import run_distributed
from tests.moe import overlap_workers
from tests.moe.workers import moe_model


@pytest.fixture(scope="module")
def world2():
    return run_distributed(overlap_workers.world2, 2, timeout=300)


@pytest.mark.parametrize("case", ["dropless/tied", "capacity-drops/overlap-grad-reduce",
                                  "pseudo-shared/tied/overlap-grad-reduce", "fp16/loss-scale",
                                  "dense-and-moe/recompute-selective"])
def test_overlapped_schedule_is_bitwise_the_serial_one(world2, case):
    for rank, res in enumerate(world2):
        r = res[case]
        assert r["overlapped_losses"] == r["losses"], f"rank {rank}"
        assert not r["grads_differ"], f"rank {rank}: gradients differ: {r['grads_differ']}"
        assert not r["weights_differ"], f"rank {rank}: weights differ by up to {r['moved']}: {r['weights_differ']}"
        assert r["most_in_flight"] == 2, f"rank {rank}: {r['most_in_flight']} all-to-alls in flight at most"


def test_overlapped_schedule_is_bitwise_the_serial_one_under_tp_and_sequence_parallel():
    for rank, res in enumerate(run_distributed(overlap_workers.world4, 4, timeout=300)):
        r = res["tp2/sequence-parallel"]
        assert r["overlapped_losses"] == r["losses"], f"rank {rank}"
        assert not r["grads_differ"] and not r["weights_differ"], f"rank {rank}: {r}"
        assert r["most_in_flight"] == 2, f"rank {rank}"


@pytest.mark.parametrize("overrides, expected", [
    (dict(ep=1), "--expert-model-parallel-size > 1"),
    (dict(ep=2, pp=2, pipeline_schedule="gpipe"), "--pipeline-schedule 1f1b"),
    (dict(ep=2, pp=2, num_layers_per_virtual_pipeline_stage=1, overlap_p2p_communication=True),
     "--no-overlap-p2p-communication"),
    (dict(ep=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     "--recompute-granularity full"),
    (dict(ep=2, compile=True), "--compile"),
])
def test_flag_rules(overrides, expected):
    cfg = moe_model(**overrides)
    with pytest.raises(ConfigError, match=expected.replace("-", r"\-").replace(">", ".")):
        validate(cfg.replace(overlap_moe_expert_parallel_comm=True), world_size=4)


def test_pipeline_parallelism_is_allowed_with_1f1b():
    validate(moe_model(ep=2, pp=2).replace(overlap_moe_expert_parallel_comm=True), world_size=4)
    validate(moe_model(ep=2, pp=2, num_layers_per_virtual_pipeline_stage=1, overlap_p2p_communication=False)
             .replace(overlap_moe_expert_parallel_comm=True), world_size=4)
