"""Stage memory is bounded by the schedule, not by the number of micro-batches.

A 1F1B stage holds at most P - s micro-batches' activations; everything else a step creates --
the output sent to the next stage, the buffers of sends, received activations and their
gradients -- must be released as the schedule goes. Peak live bytes are measured by the
planner tests' allocation tracker (``tests/planning/test_planner.py``: every storage an op creates,
until its last reference dies), beyond the parameters and their gradients.
"""

from __future__ import annotations


def test_peak_live_bytes_do_not_grow_with_microbatches(world4):
    """PP=4, micro-batches of one shape: each stage's peak is the same with m = 4, 8 and 16 for
    1F1B training and evaluation, with m = 8, 16, 24 for interleaved 1F1B, its receives posted
    ahead (--overlap-p2p-communication) or not (observed: equal to the byte;
    before, stage s grew by one hidden tensor per micro-batch and per direction it sends: the
    buffers p2p kept until the step's end)."""
    for r in world4:
        for run in ("1f1b", "eval", "interleaved", "overlapped"):
            peak = r["peak_bytes"][run]
            assert len(set(peak.values())) == 1, (r["peak_bytes"]["stage"], run, peak)


def test_sent_outputs_are_freed_before_their_backward(world4):
    """Stage s of P=4 holds up to P-s-1 outputs it has sent whose backward has not come yet:
    keeping them (no ``deallocate_output``) costs that many hidden tensors at the peak."""
    for r in world4:
        peak, s = r["peak_bytes"], r["peak_bytes"]["stage"]
        kept = peak["outputs_kept"] - peak["1f1b"][16]
        assert kept >= 0.99 * (3 - s) * peak["hidden_bytes"], (s, kept, peak)
