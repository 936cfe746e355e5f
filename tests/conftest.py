"""Fixtures for every test."""
import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_outlives_its_test():
    """Training code run in the pytest process (``pretrain`` joins a one-rank gloo group when
    none exists) leaves ``torch.distributed`` initialised; close it when the test ends, so no
    test inherits another's group. Distributed tests run their ranks in other processes
    (``megatron_p2r.testing.run_distributed``), which close their own."""
    assert not dist.is_initialized(), "a process group was left open before this test (by a fixture?)"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
