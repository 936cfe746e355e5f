"""A run can change the interleaving: checkpoints follow the physical pipeline stages, and a
run with the same TP, PP and EP reads each piece from the file the checkpoint's table names."""

import os

from megatron_p2r.convert.reshard import Target, convert
from tests.harness import run_distributed
from tests.checkpoint.common import cfg_of, metadata

# PP=2, 4 layers: v=2 puts layers 0 and 2 on stage 0, 1 and 3 on stage 1; v=1 puts 0-1 and 2-3.
# No dropout: the RNG streams are per pipeline rank, so they would drive other layers after the change.
BASE = dict(num_layers=4, pipeline_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
V2 = dict(num_layers_per_virtual_pipeline_stage=1)
# the distributed optimizer shards the tied embedding's state over its (first, last stage) group
DISTOPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)


def _runs(rank, world, root):
    """4 steps with v=1; 2 steps with v=2, resumed with v=1; 2 steps with v=1, resumed with v=2;
    the first again under the distributed optimizer."""
    from megatron_p2r.training import pretrain

    out = {"straight": pretrain(cfg_of(save=os.path.join(root, "a"), **BASE))["losses"]}
    for name, first, second in (
        ("v2_then_v1", V2, {}),
        ("v1_then_v2", {}, V2),
        ("v2_then_v1_distopt", {**V2, **DISTOPT}, DISTOPT),
    ):
        d = os.path.join(root, name)
        out[name] = (
            pretrain(cfg_of(save=d, exit_interval=2, **BASE, **first))["losses"]
            + pretrain(cfg_of(load=d, save=d, **BASE, **second))["losses"]
        )
    return out


def test_save_interleaved_load_plain_and_back(tmp_path):
    """Losses of the resumed runs follow the straight run (within 1e-6 relative: interleaving
    gives bitwise the gradients of 1F1B, but the global norm for clipping is summed over
    differently filled stages), and the interleaved checkpoint places each layer in the file
    of the stage whose chunk holds it."""
    results = run_distributed(_runs, 2, str(tmp_path))[0]
    straight = results["straight"]
    for name in ("v2_then_v1", "v1_then_v2", "v2_then_v1_distopt"):
        assert len(results[name]) == 4
        for got, want in zip(results[name], straight, strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (name, results[name], straight)
    saved_v2 = metadata(str(tmp_path / "v2_then_v1" / "iter_0000002"))
    assert saved_v2["layout"] == {"tp": 1, "pp": 2, "ep": 1, "stage_layers": [[0, 1], [1, 2], [2, 3], [3, 4]]}
    stages = {k: t["stage"] for k, t in saved_v2["tensors"].items() if k.endswith("input_norm.weight")}
    assert stages == {f"layers.{i}.input_norm.weight": i % 2 for i in range(4)}
    saved_v1 = metadata(str(tmp_path / "v2_then_v1" / "iter_0000004"))
    assert saved_v1["layout"]["stage_layers"] == [[0, 2], [2, 4]]
    assert saved_v1["tensors"]["layers.2.input_norm.weight"]["stage"] == 1
    # the converter reads interleaved files too; to another PP it writes the plain split
    # (convert verifies every written tensor against the source before publishing)
    out = convert(
        str(tmp_path / "v2_then_v1" / "iter_0000002"),
        str(tmp_path / "pp1"),
        Target(pipeline_parallel_size=1),
        progress=False,
    )
    assert metadata(out)["layout"] == {"tp": 1, "pp": 1, "ep": 1, "stage_layers": [[0, 4]]}
    tp2 = convert(
        str(tmp_path / "v2_then_v1" / "iter_0000002"),
        str(tmp_path / "tp2"),
        Target(tensor_parallel_size=2),
        progress=False,
    )
    assert metadata(tp2)["layout"]["stage_layers"] == [[0, 1], [1, 2], [2, 3], [3, 4]]  # PP kept: so is v
