"""How a failed or timed-out collective is explained."""

from megatron_p2r.reliability import describe_distributed_failure


def test_describe_distributed_failure_recognises_backend_errors_only():
    """(The collective's and caller's names, read off a real traceback, are checked by the
    stalled-rank test in test_faults.py.)"""
    try:
        raise RuntimeError(
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
        )
    except RuntimeError as exc:
        message = describe_distributed_failure(exc, 0.05)
    assert message.startswith("collective operation timed out after 0.05 min (--distributed-timeout-minutes)")
    assert "Backend said: [gloo" in message
    assert describe_distributed_failure(ValueError("unrelated"), 1.0) is None
