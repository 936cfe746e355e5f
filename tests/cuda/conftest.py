"""Fixtures of the GPU lane (tests/cuda). Nothing heavy is imported here at collection: the
test modules skip themselves first (``probe.skip_without_cuda``) when there is no GPU."""
import os

import pytest

# cuBLAS picks reduction orders by workspace size: fixed, so the bitwise tests are reproducible
# (read when the first cuBLAS handle is created, i.e. before any matmul of this process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="session")
def lane():
    from tests.cuda.lane import open_lane
    with open_lane() as opened:
        yield opened


@pytest.fixture(autouse=True)
def no_process_group_outlives_its_test():
    """Replaces the root rule (tests/conftest.py) here: the lane's tests share one one-rank job
    that ``lane`` opens for the session and closes at its end, so a group is open by design
    when each of them starts."""
    yield
