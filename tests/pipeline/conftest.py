"""One spawn per world size for all pipeline tests (a spawn costs seconds, a case milliseconds)."""

import pytest

from tests.harness import run_distributed
from tests.pipeline import workers


@pytest.fixture(scope="session")
def world4():
    return run_distributed(workers.world4, 4, timeout=400)


@pytest.fixture(scope="session")
def world8():
    return run_distributed(workers.world8, 8, timeout=400)
