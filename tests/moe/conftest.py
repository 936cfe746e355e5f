"""One spawn per world size for all expert-parallel tests (a spawn costs seconds, a case far less)."""

import pytest

from tests.harness import run_distributed
from tests.moe import workers


@pytest.fixture(scope="session")
def moe_log_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_log") / "log.jsonl")


@pytest.fixture(scope="session")
def moe_world2(moe_log_file):
    return run_distributed(workers.world2, 2, moe_log_file, timeout=300)


@pytest.fixture(scope="session")
def moe_world4():
    return run_distributed(workers.world4, 4, timeout=400)
