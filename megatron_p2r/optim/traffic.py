"""The memory traffic of one host optimizer step, per stepped element: what its kernel reads and
writes, counted from the dtypes of the tensors it touches. The kernels (one pass over the flat
shard for AdamW and Lion; three for a factored Adafactor matrix) are written to move exactly
this, the benchmark (``benchmarks/host_optimizer.py``) reports it beside the measured time, and
the planner divides it by the host's bandwidth.

Dtypes are the flags' names: "fp32", "bf16", "fp16".
"""

from __future__ import annotations

from typing import Mapping, Optional

from megatron_p2r.config import OPTIMIZERS

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def kernel_bytes_per_element(
    optimizer: str, main: str, grad: str, moments: Mapping[str, str], weight: Optional[str]
) -> int:
    """Bytes moved per element by one step of ``optimizer`` (a kind of config/optimizers.py: an
    elementwise one moves its moments, a factored one makes three passes).

    ``main``: the main parameter's dtype (read and written); ``grad``: the gradient's (read);
    ``moments``: moment name -> dtype (each read and written; AdamW's ``exp_avg`` and
    ``exp_avg_sq``, Lion's ``exp_avg``); ``weight``: the 16-bit weight the updated main is rounded
    into in the same pass, None when the main is the weight itself.

    A factored Adafactor matrix keeps statistics per row and column (negligible traffic) and
    needs three passes: the gradient's squared row/column sums (reads the gradient), the update's
    sum of squares for clipping (reads the gradient), and the update (reads gradient and main,
    writes main, and sums the new main's squares for the next step's relative step size). A
    step's first pass reads the main too when that sum is not known (the first step, or after
    the main was written elsewhere): ``m`` more bytes, once.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    m, g = BYTES[main], BYTES[grad]
    w = BYTES[weight] if weight is not None else 0
    if OPTIMIZERS[optimizer].factored:
        return 3 * g + 2 * m + w
    return 2 * m + g + sum(2 * BYTES[d] for d in moments.values()) + w
