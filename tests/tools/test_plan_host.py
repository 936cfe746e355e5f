"""Host memory is a tier of the verdict: each GPU preset carries its node's host memory, the
per-GPU and per-node overrides set it, and a plan whose offloaded state overflows a node does
not fit, with the tier and the excess named in the text and in ``--json``."""

from __future__ import annotations

import json

import pytest

from megatron_p2r.layout.ranks import Layout
from megatron_p2r.planning.hardware import GPU_PRESETS, GiB, TiB
from megatron_p2r.planning.verdict import host_tier
from tools.plan import main
from tests.planning.plan_argv import OFFLOADED, TEN_T


# Two pipeline stages, each offloading a layer, on 12 GPUs: a full node of 8 and a node of 4.
SMALL = OFFLOADED


def plan_json(argv, capsys) -> tuple:
    status = main(argv + ["--json"])
    return status, json.loads(capsys.readouterr().out)["plans"]


def test_presets_carry_their_node():
    assert {name: (g.gpus_per_node, g.host_memory_per_node) for name, g in GPU_PRESETS.items()} == {
        "V100-32GB": (8, 768 * GiB),
        "A100-80GB": (8, TiB),
        "H100-80GB": (8, 2 * TiB),
        "H200-141GB": (8, 2 * TiB),
        "H800-80GB": (8, 2 * TiB),
    }


@pytest.mark.parametrize("preset,fits", [("V100-32GB", False), ("A100-80GB", True), ("H100-80GB", True)])
def test_preset_host_check(preset, fits):
    """100 GiB offloaded per GPU is 800 GiB per 8-GPU node: more than a V100 node's 768 GiB,
    less than an A100 node's 1 TiB."""
    tier = host_tier([100 * GiB], Layout.from_world(16), GPU_PRESETS[preset])
    assert tier.need == 800 * GiB and tier.fits is fits
    assert tier.over == (0 if fits else 32 * GiB)
    assert tier.where == "node 0 (ranks 0-7)"


def test_the_10t_real_phase_overflows_the_v100_node(capsys):
    """Without any host flag the preset's node is checked: no FITS that ignores the host."""
    status, plans = plan_json(TEN_T, capsys)
    assert status == 1 and plans["pseudo"]["fits"] and not plans["real"]["fits"]
    host, gpu = plans["real"]["tiers"]["host"], plans["real"]["tiers"]["gpu"]
    assert host["capacity"] == plans["real"]["host_capacity_per_node"] == 768 * GiB
    assert not host["fits"] and host["over"] == host["need"] - 768 * GiB > 1800 * GiB
    assert gpu["fits"] and gpu["over"] == 0 and gpu["capacity"] == GPU_PRESETS["V100-32GB"].memory
    assert main(TEN_T) == 1
    out = capsys.readouterr().out
    assert (
        f"DOES NOT FIT: host overflows by {host['over'] / GiB:.2f} GiB: node 0 (ranks 0-7) needs "
        f"{host['need'] / GiB:.2f} of 768.00 GiB; GPU fits: rank 0 (stage 0) needs" in out
    )
    assert "does not fit on host: node 0 (ranks 0-7) holds" in out


def test_per_node_override_is_exact_and_equals_the_per_gpu_form(capsys):
    status, plans = plan_json(SMALL, capsys)
    need = plans["real"]["tiers"]["host"]["need"]
    assert status == 0 and need > 0 and plans["real"]["tiers"]["host"]["where"] == "node 0 (ranks 0-7)"
    status, plans = plan_json(SMALL + ["--host-memory-per-node", str(need)], capsys)
    assert status == 0 and plans["real"]["tiers"]["host"]["over"] == 0
    status, plans = plan_json(SMALL + ["--host-memory-per-node", str(need - 1)], capsys)
    host = plans["real"]["tiers"]["host"]
    assert status == 1 and not plans["real"]["fits"] and (host["fits"], host["over"]) == (False, 1)
    assert plans["real"]["tiers"]["gpu"]["fits"]
    assert main(SMALL + ["--host-memory-per-node", str(need - 1)]) == 1
    assert "DOES NOT FIT: host overflows by 0.00 GiB: node 0 (ranks 0-7)" in capsys.readouterr().out
    # --host-memory is per GPU: a node has 8 of it
    per_gpu = -(-need // 8)
    _, plans = plan_json(SMALL + ["--host-memory", str(per_gpu)], capsys)
    assert plans["real"]["tiers"]["host"]["capacity"] == 8 * per_gpu and plans["real"]["fits"]


def test_gpus_per_node_keeps_the_presets_share_per_gpu(capsys):
    """A 16-GPU V100 node (a DGX-2) has twice the 8-GPU node's host memory unless told otherwise."""
    _, plans = plan_json(SMALL + ["--gpus-per-node", "16"], capsys)
    assert plans["real"]["tiers"]["host"]["capacity"] == 1536 * GiB
    assert plans["real"]["tiers"]["host"]["where"] == "node 0 (ranks 0-11)"
    _, plans = plan_json(SMALL + ["--gpus-per-node", "16", "--host-memory-per-node", "1TiB"], capsys)
    assert plans["real"]["tiers"]["host"]["capacity"] == TiB


def test_host_flags_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(SMALL + ["--host-memory", "96GiB", "--host-memory-per-node", "768GiB"])
    assert exc.value.code == 2
    assert "--host-memory-per-node: not allowed with argument --host-memory" in capsys.readouterr().err


# example -> (real-phase file, extra flags, exit status) of each command its README shows, in order;
# the README shows both phases' verdicts of the first and the real phase's of the others
BF16_GRADS = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]
README_COMMANDS = {
    "m6_10t": [
        ("real.yaml", [], 1),
        ("real_lean.yaml", ["--host-memory", "192GiB"], 0),
        ("real_lean.yaml", ["--host-memory", "96GiB", "--cpu-offload-optimizer-nvme-path", "/local/nvme"], 1),
        (
            "real_lean.yaml",
            ["--host-memory", "96GiB", "--cpu-offload-optimizer-nvme-path", "/local/nvme", *BF16_GRADS],
            0,
        ),
        ("real_lean.yaml", ["--host-memory", "192GiB", *BF16_GRADS], 0),
        ("real_lean.yaml", ["--host-memory", "192GiB", *BF16_GRADS, "--cpu-offload-delayed-param-update"], 0),
        (
            "real_lean.yaml",
            ["--host-node", "DGX-2", "--gpus-per-node", "16", *BF16_GRADS, "--cpu-offload-delayed-param-update"],
            1,
        ),
    ],
    "m6_1t": [("real.yaml", [], 0)],
}


# the other printed lines a README quotes (each must be one of its commands' lines)
QUOTED = ("== Pseudo-to-Real: ", "host step (", "delayed parameter update (", "warning: ")


@pytest.mark.parametrize("example", list(README_COMMANDS))
def test_example_readmes_show_the_verdicts_their_command_prints(example, capsys):
    with open(f"examples/{example}/README.md", encoding="utf-8") as fh:
        readme = fh.read().splitlines()
    shown = [line for line in readme if line.strip().startswith(("FITS: ", "DOES NOT FIT: "))]
    printed, lines = [], set()
    for i, (real, extra, status) in enumerate(README_COMMANDS[example]):
        argv = [
            "--config",
            f"examples/{example}/model.yaml",
            "--pseudo-config",
            f"examples/{example}/pseudo.yaml",
            "--real-config",
            f"examples/{example}/{real}",
            "--world-size",
            "512",
            "--gpu",
            "V100-32GB",
            "--token-budget",
            "50B",
            *extra,
        ]
        assert main(argv) == status
        out = capsys.readouterr().out.splitlines()
        lines.update(out)
        verdicts = [line for line in out if "FIT" in line and not line.startswith("   !")]
        printed += verdicts if i == 0 else verdicts[-1:]
    assert shown == printed
    quoted = [line for line in readme if line.strip().startswith(QUOTED)]
    assert [line for line in quoted if line not in lines] == []
