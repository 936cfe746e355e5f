"""Fixtures of the GPU lane (tests/cuda). Nothing heavy is imported here at collection: the
test modules skip themselves first (``probe.skip_without_cuda``) when there is no GPU."""

import os

import pytest

# cuBLAS picks reduction orders by workspace size: fixed, so the bitwise tests are reproducible
# (read when the first cuBLAS handle is created, i.e. before any matmul of this process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def lane():
    """The one-rank job, joined for one test and left after it: the suite's guard
    (``tests/conftest.py``) requires that no process group outlives a test, and the groups a
    test makes (the MoE test's ep group) go with the job."""
    from tests.cuda.lane import open_lane

    with open_lane() as opened:
        yield opened
