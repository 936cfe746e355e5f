"""Fixtures for every test, and the ``spawns`` marker (``make test-fast`` deselects it)."""

import functools
import pathlib
import re

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_outlives_its_test():
    """Training code run in the pytest process (``pretrain`` joins a one-rank gloo group when
    none exists) leaves ``torch.distributed`` initialised; close it when the test ends, so no
    test inherits another's group. Distributed tests run their ranks in other processes
    (``tests.harness.run_distributed``), which close their own."""
    assert not dist.is_initialized(), "a process group was left open before this test (by a fixture?)"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_mtp_losses_outlive_their_test():
    """A model's forward with gradients records its MTP depths' losses until a training step pops
    them (model/mtp.py); a test that runs the model by hand leaves them for the next test's step,
    which may have fewer depths. Drop them when each test ends."""
    yield
    from megatron_p2r.model import mtp

    mtp.pop_losses(None, None, ())


# What starts other processes (gloo ranks, torchrun, the CLI, tools): ``make test-fast`` leaves
# those tests out. A test module spawns when its source, or a module under tests/ that it
# imports, names one of these.
SPAWNS = re.compile(r"run_distributed|subprocess|torchrun|multiprocessing|mp\.spawn|os\.fork")
TESTS = pathlib.Path(__file__).parent
LOCAL_IMPORT = re.compile(r"^\s*from\s+(tests(?:\.\w+)+)\s+import|^\s*import\s+(tests(?:\.\w+)+)", re.M)


@functools.lru_cache(maxsize=None)
def _spawns(path: pathlib.Path) -> bool:
    source = path.read_text(encoding="utf-8")
    if SPAWNS.search(source):
        return True
    for match in LOCAL_IMPORT.finditer(source):
        module = TESTS.parent.joinpath(*(match.group(1) or match.group(2)).split("."))
        candidate = module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__init__.py"
        if candidate.exists() and candidate != path and _spawns(candidate):
            return True
    return False


def _fixture_files(item) -> list:
    """The files defining the fixtures ``item`` uses (a conftest.py whose fixtures start ranks)."""
    files = set()
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            code = getattr(fixturedef.func, "__code__", None)
            if code is not None and code.co_filename != __file__:
                files.add(pathlib.Path(code.co_filename))
    return sorted(files)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if any(_spawns(f) for f in [path, *_fixture_files(item)] if f.is_relative_to(TESTS)):
            item.add_marker(pytest.mark.spawns)
