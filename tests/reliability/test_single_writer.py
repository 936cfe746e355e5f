"""Two runs on one --save: the second is refused on every rank before it reads or repairs the
directory, and the first finishes with all its checkpoints intact."""

import os
import threading
import time

from megatron_p2r.checkpoint.integrity import check_files
from megatron_p2r.checkpoint.lock import LOCK_FILE
from megatron_p2r.checkpoint.metadata import read_metadata
from megatron_p2r.checkpoint.naming import complete_iterations, iteration_dir_name, resolve_iteration_dir
from tests.reliability.common import FLAGS, launch

ARGV = FLAGS + ["--train-iters", "4", "--save-interval", "1"]


def test_a_second_run_on_the_same_save_directory_is_refused(tmp_path):
    ck = tmp_path / "ck"
    first = {}
    # The first run sleeps 20 s before iteration 3, after saving 1 and 2: the second starts meanwhile.
    thread = threading.Thread(
        target=lambda: first.update(
            r=launch(
                ARGV + ["--save", str(ck), "--load", str(ck)],
                1,
                env={"P2R_FAULT": "stall:3:20@rank0"},
                out_dir=str(tmp_path),
                timeout=240,
            )
        )
    )
    thread.start()
    deadline = time.time() + 200
    while not (ck / iteration_dir_name(2)).is_dir():
        assert time.time() < deadline and thread.is_alive(), first
        time.sleep(0.2)
    assert (ck / LOCK_FILE).is_file()
    second = launch(
        ARGV + ["--save", str(ck), "--load", str(ck), "--train-iters", "6"], 2, out_dir=str(tmp_path), timeout=200
    )
    thread.join()
    [(rc0, out0), (rc1, out1)] = second
    assert rc0 == 2 and f"error: {ck} is in use by training run (pid" in out0, out0
    assert rc1 == 2 and "error: --save" in out1 and "is in use by another run (rank 0 says which)" in out1, out1
    assert "loaded checkpoint" not in out0 + out1 and "checkpoint recovery" not in out0 + out1
    [(rc, out)] = first["r"]
    assert rc == 0, out
    assert complete_iterations(str(ck)) == [1, 2, 3, 4] and not (ck / LOCK_FILE).exists()
    for iteration in range(1, 5):
        iter_dir = str(ck / iteration_dir_name(iteration))
        meta = read_metadata(iter_dir)
        assert meta["iteration"] == iteration
        check_files(iter_dir, meta)  # every shard present, its recorded size, the expected tensors
    assert resolve_iteration_dir(str(ck)).endswith(iteration_dir_name(4))
    assert sorted(os.listdir(ck / iteration_dir_name(4))) == [
        "metadata.json",
        "mp_rank_00_000_000.safetensors",
        "rng_and_data",
    ]
