"""The optimizer state of host-offloaded layers on local NVMe (``--cpu-offload-optimizer-nvme-path``,
``offload/nvme.py``): training with the state in a mapped file is bitwise training with it in RAM
(losses, gradient norms, weights, optimizer state) — AdamW, Lion, Adafactor, fp32 and bf16, the
serial and the overlapped host step, one process, PP=2 and DP=2 with the distributed optimizer;
every main and state tensor of the host step lives in the file, and the rank's own memory
drops by exactly the bytes moved, which are the plan's; checkpoints go between the two both ways
and resume bitwise; a bad directory is a clear error.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.config import ConfigError, validate
from megatron_p2r.layout.offload import format_bytes
from megatron_p2r.offload import nvme
from megatron_p2r.offload.runtime import format_report
from megatron_p2r.parallel.random import seed_everything
from megatron_p2r.parallel.state import ParallelState
from tests.harness import run_distributed
from megatron_p2r.training import setup_parallel
from tests.helpers import run_steps, tiny_config

# The learning rate changes every step and weight decay is on; layers 0 and 2 of 4 on host.
BASE = dict(
    num_layers=4,
    global_batch_size=4,
    cpu_offload_layers="0,2",
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    weight_decay=0.1,
)
OVERLAP = dict(overlap_cpu_optimizer_d2h_h2d=True)


def _train(ps: ParallelState, directory, steps: int = 3, load=None, **kw) -> dict:
    cfg = tiny_config(**{**BASE, **kw}, cpu_offload_optimizer_nvme_path=None if directory is None else str(directory))
    seed_everything(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
    outs: list = []
    losses, state = run_steps(cfg, ps, steps, outputs=outs, load=load)
    state.optimizer.finish_host_step()
    opt = state.optimizer
    host = [ms for ms in opt.shards if ms.placement == "host"]
    return {
        "losses": losses,
        "norms": [o["grad_norm"] for o in outs],
        "state": state,
        "weights": {n: p.detach().clone() for n, p in state.model.named_parameters()},
        "mains": {(ms.name, ms.start): ms.main.detach().clone() for ms in opt.shards},
        "moments": {
            (ms.name, ms.start): {k: v.clone() for k, v in opt.inner[ms.placement].state[ms.main].items()}
            for ms in opt.shards
        },
        "host": [(ms, opt.inner["host"].state[ms.main]) for ms in host],
    }


def _bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    for n, w in a["weights"].items():
        assert torch.equal(w, b["weights"][n]), n
    assert a["mains"].keys() == b["mains"].keys() and a["moments"].keys() == b["moments"].keys()
    for key, m in a["mains"].items():
        assert torch.equal(m, b["mains"][key]), key
        assert a["moments"][key].keys() == b["moments"][key].keys() and a["moments"][key], key
        for kind, v in a["moments"][key].items():
            assert torch.equal(v, b["moments"][key][kind]), (key, kind)


def _in_file(run: dict) -> None:
    """Every fp32 copy of a 16-bit weight and every state tensor but the step count of the host
    step lives in the mapped file; nothing else does."""
    file = run["state"].offload.nvme.file
    assert run["host"]
    for ms, state in run["host"]:
        assert file.holds(ms.main) == (not ms.aliases_param), ms.name
        assert {k: file.holds(v) for k, v in state.items()} == {k: k != "step" for k in state}
    for p in run["state"].model.parameters():
        assert not file.holds(p)


CASES = [
    ({}, "fp32-adamw"),
    (dict(bf16=True), "bf16-adamw"),
    (dict(bf16=True, optimizer="lion"), "bf16-lion"),
    (dict(optimizer="adafactor"), "fp32-adafactor"),
    (dict(bf16=True, optimizer="adafactor"), "bf16-adafactor"),
    (
        dict(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
        "bf16-moments",
    ),
    (dict(bf16=True, **OVERLAP), "bf16-overlapped"),
    (dict(bf16=True, clip_grad=0.0, host_optimizer_threads=2, **OVERLAP), "bf16-in-backward-2-threads"),
]


@pytest.mark.parametrize("kw", [c for c, _ in CASES], ids=[i for _, i in CASES])
def test_nvme_is_bitwise_the_ram_run(tmp_path, kw):
    ps = ParallelState.single()
    ram, disk = _train(ps, None, **kw), _train(ps, tmp_path, **kw)
    _bitwise(ram, disk)
    _in_file(disk)


def _dp2(rank, world, directory):
    """DP=2 with the distributed optimizer: each rank's host shards (some weights cut between the
    ranks; Adafactor sums the statistics of a cut matrix over both) in its own file."""
    kw = dict(use_distributed_optimizer=True, bf16=True)
    ps, _ = setup_parallel(tiny_config(**{**BASE, **kw}), torch.device("cpu"))
    for optimizer in ("adam", "adafactor"):  # a directory per run: a run holds its files while it lives
        os.makedirs(os.path.join(directory, optimizer), exist_ok=True)
        ram = _train(ps, None, optimizer=optimizer, **kw)
        disk = _train(ps, os.path.join(directory, optimizer), optimizer=optimizer, **kw)
        _bitwise(ram, disk)
        _in_file(disk)
        assert os.path.basename(disk["state"].offload.nvme.file.path) == f"optimizer-state-rank{rank:05d}.bin"
    return True


def _pp2(rank, world, directory):
    kw = dict(pipeline_model_parallel_size=2, global_batch_size=8, bf16=True)
    ps, _ = setup_parallel(tiny_config(**{**BASE, **kw}), torch.device("cpu"))
    for i, extra in enumerate(({}, OVERLAP)):
        os.makedirs(os.path.join(directory, str(i)), exist_ok=True)
        ram, disk = _train(ps, None, **kw, **extra), _train(ps, os.path.join(directory, str(i)), **kw, **extra)
        _bitwise(ram, disk)
        _in_file(disk)
    return True


@pytest.mark.parametrize("worker", [_dp2, _pp2], ids=["dp2-distributed-optimizer", "pp2-1f1b"])
def test_nvme_is_bitwise_the_ram_run_on_two_ranks(tmp_path, worker):
    assert run_distributed(worker, 2, str(tmp_path)) == [True, True]


def _ram_bytes(run: dict) -> int:
    """Bytes of the distinct storages the rank holds in its own memory: weights, gradient buffers,
    mains and optimizer state (step counts aside, as ``training.describe_memory``)."""
    state, nvme_state = run["state"], run["state"].offload.nvme
    opt = state.optimizer
    tensors = [
        *state.model.parameters(),
        *state.ddp.buffer_tensors("grads"),
        *(ms.main for ms in opt.shards),
        *(v for inner in opt.inner.values() for s in inner.state.values() for k, v in s.items() if k != "step"),
    ]
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if nvme_state is None or not nvme_state.file.holds(t)
    }
    return sum(seen.values())


@pytest.mark.parametrize(
    "kw",
    [dict(bf16=True), dict(bf16=True, optimizer="adafactor"), {}],
    ids=["bf16-adamw", "bf16-adafactor", "fp32-adamw"],
)
def test_ram_drops_by_the_bytes_moved_which_the_plan_counts(tmp_path, kw):
    ps = ParallelState.single()
    ram, disk = _train(ps, None, steps=1, **kw), _train(ps, tmp_path, steps=1, **kw)
    file = disk["state"].offload.nvme.file
    moved = sum(ms.main.numel() * 4 for ms, _ in disk["host"] if file.holds(ms.main)) + sum(
        v.numel() * v.element_size() for _, s in disk["host"] for k, v in s.items() if k != "step"
    )
    report, before = disk["state"].offload.describe(), ram["state"].offload.describe()
    assert moved == report["nvme"] == before["host"]["optimizer"] > 0 and report["host"]["optimizer"] == 0
    assert f"NVMe: optimizer {format_bytes(moved)} in {file.path}" in format_report(0, report)
    assert _ram_bytes(ram) - _ram_bytes(disk) == moved
    assert file.nbytes >= moved


@pytest.mark.parametrize("saved_on,loaded_on", [("nvme", "ram"), ("ram", "nvme"), ("nvme", "nvme")])
def test_checkpoint_switches_between_nvme_and_ram_and_resumes_bitwise(tmp_path, saved_on, loaded_on):
    """3 steps straight, or 2, save, load into a fresh run with the state on either tier, 1 more
    (each run's file in its own directory)."""
    ps = ParallelState.single()

    def where(tier: str, run: str):
        if tier == "ram":
            return None
        (tmp_path / run).mkdir()
        return tmp_path / run

    kw = {
        ("nvme", "ram"): dict(bf16=True, optimizer="adafactor"),
        ("ram", "nvme"): dict(bf16=True),
        ("nvme", "nvme"): dict(bf16=True, clip_grad=0.0, **OVERLAP),
    }[saved_on, loaded_on]
    straight = _train(ps, where(loaded_on, "straight"), steps=3, **kw)
    first = _train(ps, where(saved_on, "first"), steps=2, **kw)
    save_checkpoint(str(tmp_path / "ckpt"), first["state"])
    resumed = _train(ps, where(loaded_on, "resumed"), steps=1, load=str(tmp_path / "ckpt"), **kw)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    _bitwise({**straight, "losses": [], "norms": []}, {**resumed, "losses": [], "norms": []})
    if loaded_on == "nvme":  # in the file from the load on, not only after the next step
        _in_file(_train(ps, where(loaded_on, "loaded"), steps=0, load=str(tmp_path / "ckpt"), **kw))


def test_prefetch_asks_for_the_next_layer_in_step_order(tmp_path, monkeypatch):
    """Serial: forward order; steps started in backward: backward order."""
    asked = []
    monkeypatch.setattr(nvme.NvmeStateFile, "prefetch", lambda self, key: asked.append(key))
    (tmp_path / "serial").mkdir(), (tmp_path / "overlapped").mkdir()  # a directory per run (each holds its files)
    _train(ParallelState.single(), tmp_path / "serial", steps=1, bf16=True)
    assert asked == [0, 2, 2, None]
    asked.clear()
    _train(ParallelState.single(), tmp_path / "overlapped", steps=1, bf16=True, clip_grad=0.0, **OVERLAP)
    assert asked == [2, 0, 0, None]


def test_bad_directory_is_a_clear_error(tmp_path, monkeypatch):
    ps = ParallelState.single()
    with pytest.raises(ConfigError, match="nvme-path .*missing.*: not an existing directory"):
        _train(ps, tmp_path / "missing", steps=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not an existing directory"):
        _train(ps, tmp_path / "file", steps=0)
    with pytest.raises(ConfigError, match=r"cannot lock /proc: .*optimizer-state-rank00000.lock\).*must be writable"):
        _train(ps, "/proc", steps=0)

    class Full:
        free = 4096

    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: Full)
    with pytest.raises(
        ConfigError,
        match=r"optimizer state needs .* \(\d+ bytes\) in .*rank00000.bin, the disk has "
        r"4.00 KiB free",
    ):
        _train(ps, tmp_path, steps=0)


def test_nvme_path_needs_host_resident_weights():
    with pytest.raises(
        ConfigError, match="--cpu-offload-optimizer-nvme-path .* needs --cpu-offload-what params,grads,optimizer"
    ):
        validate(tiny_config(**BASE, cpu_offload_what="optimizer", cpu_offload_optimizer_nvme_path="/tmp"), 1)


def test_nvme_path_without_offloaded_layers_holds_nothing(tmp_path):
    """A pseudo phase run (or planned) with its real phase's flags: no file, RAM as without the flag."""
    run = _train(ParallelState.single(), tmp_path, steps=1, cpu_offload_layers=None)
    assert run["state"].offload is None and not list(tmp_path.iterdir())


def _resident_pages(file: nvme.NvmeStateFile, key: int) -> int:
    """Pages of layer ``key``'s region in memory (mincore)."""
    import ctypes
    import mmap

    start, end, _ = file.regions[key]
    vec = (ctypes.c_ubyte * ((end - start) // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(file.bytes.data_ptr() + start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_read_ahead_brings_a_layers_pages_in(tmp_path):
    """Evicted pages are back in memory once the reader thread has read the layer ahead."""
    file = nvme.NvmeStateFile(str(tmp_path), 0, {0: 1 << 20, 1: 1 << 20})
    file.bytes.fill_(7)
    file.evict()
    assert _resident_pages(file, 0) == _resident_pages(file, 1) == 0
    file.prefetch(1)
    file._reader.submit(lambda: None).result()  # the read-ahead queued before it is done
    assert _resident_pages(file, 1) == (1 << 20) // 4096
