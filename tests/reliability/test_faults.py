"""Bad numbers and hangs on 2 ranks: a NaN in one rank's gradient, a rank that stalls."""

import json
import os

from megatron_p2r.reliability import parse_faults
from tests.reliability.common import FLAGS, TRACEBACK, checkpoint_tensor_files, launch

ARGV = FLAGS + ["--global-batch-size", "4", "--train-iters", "8", "--log-interval", "1"]


def test_nan_in_one_ranks_gradient_is_skipped_by_all_and_stops_with_a_checkpoint(tmp_path):
    """NaN in rank 1's (already reduced) gradients from iteration 3 on: rank 0's own gradients are
    finite, yet both ranks skip iterations 3 and 4, then stop (--max-skipped-steps 2) with exit
    code 1 and a message, after saving a checkpoint whose weights and AdamW state are bitwise those
    after iteration 2 (the reference run exits at iteration 2)."""
    ck, ref, log = tmp_path / "ck", tmp_path / "ref", tmp_path / "log.jsonl"
    results = launch(
        ARGV + ["--save", str(ck), "--max-skipped-steps", "2", "--log-file", str(log)],
        2,
        env={"P2R_FAULT": "nan_grad:3+@rank1"},
        out_dir=str(tmp_path),
    )
    for rank, (rc, out) in enumerate(results):
        assert rc == 1, (rank, out)
        assert (
            f"error: rank {rank}: training stopped: 2 consecutive steps had non-finite loss or gradients "
            f"(--max-skipped-steps 2); the last good state is saved in {ck}"
        ) in out, out
    out0 = results[0][1]
    assert "warning: iteration 3 skipped" in out0 and "warning: iteration 4 skipped" in out0
    records = [json.loads(line) for line in open(log) if "lm_loss" in line]
    assert [(r["iteration"], r["skipped"]) for r in records] == [(1, 0), (2, 0), (3, 1)]  # stops before logging 4
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "4"
    reference = launch(ARGV + ["--save", str(ref), "--exit-interval", "2"], 2, out_dir=str(tmp_path))
    assert [rc for rc, _ in reference] == [0, 0], reference
    shards = lambda d: {k: v for k, v in checkpoint_tensor_files(str(d)).items() if k.startswith("mp_rank")}
    assert shards(ck / "iter_0000004") == shards(ref / "iter_0000002")


def test_a_stalled_rank_fails_the_job_with_a_message_naming_the_collective(tmp_path):
    """Rank 1 sleeps 8 s before iteration 2; with --distributed-timeout-minutes 0.05 (3 s) rank 0's
    collective times out: both ranks exit 1 with an error line naming the operation (no hang)."""
    results = launch(
        ARGV + ["--distributed-timeout-minutes", "0.05"],
        2,
        env={"P2R_FAULT": "stall:2:8@rank1"},
        out_dir=str(tmp_path),
        timeout=90,
    )
    (rc0, out0), (rc1, out1) = results
    assert rc0 == 1 and rc1 == 1 and TRACEBACK not in (rc0, rc1), results
    assert "Traceback" not in out0 + out1
    line0 = next(line for line in out0.splitlines() if line.startswith("error:"))
    assert line0.startswith("error: rank 0: collective all_reduce called from megatron_p2r/"), line0
    assert "timed out after 0.05 min (--distributed-timeout-minutes)" in line0, line0
    assert "[P2R_FAULT] rank 1: stalling 8 s before iteration 2" in out1
    assert "error: rank 1: collective" in out1  # its peer is gone when it wakes up


def test_fault_spec_errors_are_config_errors(tmp_path):
    results = launch(FLAGS + ["--train-iters", "1"], 1, env={"P2R_FAULT": "kill_after:3"}, out_dir=str(tmp_path))
    rc, out = results[0]
    assert rc == 2 and "error: P2R_FAULT: cannot parse 'kill_after:3'" in out, out
    assert parse_faults("nan_grad:3-5@rank2")[0].covers(5, 2) and not parse_faults("nan_grad:3-5@rank2")[0].covers(6, 2)
    assert os.environ.get("P2R_FAULT") is None
