"""A tensor's placement in metadata.json (its stage, its expert index) and the latest file are
checked before they name a file: a forged value is one ``error:`` line of ``inspect`` and
``reshard``, never a ZeroDivisionError, a KeyError or a file read outside the checkpoint."""

import json
import os
import re
import shutil

import pytest

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.checkpoint.metadata import write_metadata
from megatron_p2r.parallel.state import ParallelState
from tests.helpers import run_steps, tiny_config
from tools.convert_checkpoint import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement") / "ck"
    _, state = run_steps(tiny_config(num_layers=2), ParallelState.single(), 1)
    save_checkpoint(str(root), state)
    return root


def _edited(saved, tmp_path, edit):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    path = ck / "iter_0000001" / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta["tensors"]["layers.0.mlp.fc1.weight"])
    write_metadata(str(ck / "iter_0000001"), meta)  # re-sealed: the edit reaches the checks
    return ck


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.update(expert=0, ep_dim=0),
            r"tensors\['layers.0.mlp.fc1.weight'\] has expert 0, but the config "
            r"has no experts",
        ),
        (lambda t: t.update(expert=0), "has expert 0, but the config has no experts"),
        (lambda t: t.update(ep_dim=0), "has expert None and ep_dim 0"),
        (lambda t: t.update(stage=99), r"has stage 99, but the config has 1 pipeline stage\(s\) \(0..0\)"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "reshard"])
def test_a_forged_placement_is_an_error_line(saved, tmp_path, capsys, edit, message, command):
    ck = _edited(saved, tmp_path, edit)
    argv = [command, str(ck)] + ([str(tmp_path / "out"), "--no-progress"] if command == "reshard" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_latest_file_linking_out_of_the_checkpoint_is_not_read(saved, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("1")
    os.unlink(ck / "latest_checkpointed_iteration.txt")
    os.symlink(outside, ck / "latest_checkpointed_iteration.txt")
    assert main(["inspect", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"is a link to {outside}, outside {ck}" in err
    os.unlink(ck / "latest_checkpointed_iteration.txt")
    os.symlink("iter_0000001/../latest.real", ck / "latest_checkpointed_iteration.txt")  # a link inside is fine
    (ck / "latest.real").write_text("1")
    assert main(["inspect", str(ck)]) == 0
