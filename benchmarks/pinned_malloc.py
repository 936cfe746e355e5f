"""Pin glibc malloc thresholds before a benchmark imports torch (docs/machine.md: without it,
returning the large logits buffers to the OS every step costs a share of the step and figures drift).

``import pinned_malloc`` first thing in a benchmark script: it re-executes the script once
with the environment set, since glibc reads it only at process start.
"""

import os
import sys

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "536870912",
}

if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)
