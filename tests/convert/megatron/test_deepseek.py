"""DeepSeek-V3's pieces and Megatron-LM checkpoints, import side: deepseek_dist_ep2_distopt
(tests/fixtures/megatron, written by megatron-core 0.16.1 after 3 training steps under EP2 with the
distributed optimizer: multi-latent attention, a dense first layer, a gated shared expert, sigmoid
group-limited top-k scaled by 2.5, the expert bias, one MTP layer). Its logits are compared in
test_megatron_written.py with every fixture (into TP1 and TP2); here: the expert biases (layer 1's
and the MTP layer's) bit for bit, the MTP layer's loss with the imported bias, resharding into EP2, and one more training step of ours from the imported
optimizer state against Megatron's own 4th step."""

import json
import os

import pytest
import torch

from megatron_p2r.convert.megatron.args import model_values
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.megatron.source import open_megatron
from megatron_p2r.convert.reshard import Target
from megatron_p2r.model import mtp
from tests.convert.megatron.megatron_written import ROOT, fixture_logits, loaded, logits_error

NAME = "deepseek_dist_ep2_distopt"
MEGATRON = torch.load(os.path.join(ROOT, NAME, "logits.pt"), weights_only=True)
TRAIN = dict(lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant", clip_grad=0.0, weight_decay=0.01, train_iters=10)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("deepseek") / "ours")
    _, notes = import_megatron(fixture_logits(NAME)[0], out, Target(1), progress=False)
    return out, notes


def test_megatrons_deepseek_args_are_ours():
    values, _, _ = model_values(open_megatron(fixture_logits(NAME)[0]).args)
    assert values["moe_layer_freq"] == [0, 1]  # layer 0 dense, layer 1 MoE
    assert (values["moe_router_score_function"], values["moe_router_topk_scaling_factor"]) == ("sigmoid", 2.5)
    assert (values["moe_router_num_groups"], values["moe_router_group_topk"]) == (2, 1)
    assert values["moe_router_enable_expert_bias"] and values["moe_router_bias_update_rate"] == 0.01
    assert values["moe_shared_expert_intermediate_size"] == 24 and values["moe_shared_expert_gate"]
    assert (values["mtp_num_layers"], values["mtp_loss_scaling_factor"]) == (1, 0.1)


def test_the_expert_bias_is_megatrons_bit_for_bit(imported):
    """metadata.json's expert_bias holds the trained routers' buffers exactly, layer 1's and the
    MTP layer's (non-zero: Megatron moved them 3 times), and a run loading the import routes with
    them."""
    out, _ = imported
    with open(os.path.join(out, "iter_0000003", "metadata.json")) as fh:
        saved = json.load(fh)["expert_bias"]
    theirs = {
        "layers.1.mlp.router.expert_bias": MEGATRON["expert_bias"]["decoder.layers.1.mlp.router"],
        "mtp.layers.0.layer.mlp.router.expert_bias": MEGATRON["expert_bias"][
            "mtp.layers.0.transformer_layer.mlp.router"
        ],
    }
    assert all(bias.abs().min() > 0 for bias in theirs.values())
    assert sorted(saved) == sorted(theirs)
    for name, bias in theirs.items():
        assert torch.equal(torch.tensor(saved[name], dtype=torch.float32), bias)
    state = loaded(out, 2, None)
    assert torch.equal(state.model.layers["1"].mlp.router.expert_bias, theirs["layers.1.mlp.router.expert_bias"])
    mtp_bias = state.model.mtp.layers[0].layer.mlp.router.expert_bias
    assert torch.equal(mtp_bias, theirs["mtp.layers.0.layer.mlp.router.expert_bias"])


def test_the_mtp_loss_is_megatrons(imported):
    """The MTP depth's loss on Megatron's tokens and labels, its router's bias as imported: its
    token mean over the rolled loss mask, as Megatron's tracker logged it."""
    state = loaded(imported[0], 2, None)
    tokens, labels = MEGATRON["tokens"], MEGATRON["mtp_labels"]
    state.model.eval()(tokens=tokens, labels=labels, loss_mask=torch.ones(labels.shape))
    ours = mtp.pop_losses(1, torch.device("cpu"), ())
    assert ours[0] == pytest.approx(MEGATRON["mtp_loss"][0].item(), rel=1e-5)


def test_a_megatron_run_continues_here_with_its_expert_bias(imported):
    """One training step of ours from the imported step-3 checkpoint (Adam's moments, mains, step
    and schedule from the distributed optimizer's buckets, the expert biases) on Megatron's 4th
    batch gives the logits Megatron's 4th step gave (each of its 2 ranks had the batch); with a
    fresh AdamW it does not."""
    from megatron_p2r.training import train_step

    continued = torch.load(os.path.join(ROOT, NAME, "continued.pt"), weights_only=True)
    batch = torch.cat([continued["batch"]] * 2)
    results = []
    for fresh in (False, True):
        state = loaded(imported[0], batch.shape[0], None, no_load_optim=fresh, **TRAIN)
        train_step(state, [{"tokens": batch[:, :-1], "labels": batch[:, 1:], "loss_mask": torch.ones(4, 16)}])
        with torch.no_grad():
            results.append(logits_error(state.model.eval()(tokens=continued["tokens"]).float(), continued["logits"]))
    assert results[0][1] <= 1e-5, results
    assert results[1][1] > 1e-3, results


def _ep2_error(rank, world, ckpt):
    """(max abs, rel) of this rank's logits: numbers, not tensors, cross the process boundary."""
    from tests.convert.megatron.megatron_written import our_logits

    return logits_error(our_logits(ckpt, fixture_logits(NAME)[1], world=world), fixture_logits(NAME)[2])


def test_the_import_reshards_into_ep2(tmp_path):
    """Imported into EP2 (each rank 2 of the 4 experts, of layer 1 and of the MTP layer), two
    gloo ranks compute Megatron's logits."""
    from tests.harness import run_distributed

    out = str(tmp_path / "ep2")
    import_megatron(fixture_logits(NAME)[0], out, Target(1, expert_parallel_size=2), progress=False)
    for error in run_distributed(_ep2_error, 2, out, timeout=300):
        assert error[1] <= 1e-5, error


@pytest.mark.parametrize(
    "cut, router",
    [
        ("decoder.layers.1.mlp.router.expert_bias", "layer 1's router"),
        ("mtp.layers.0.transformer_layer.mlp.router.expert_bias", "MTP depth 0's router"),
    ],
)
def test_a_missing_expert_bias_is_an_error_line(tmp_path, capsys, cut, router):
    """Args with --moe-router-enable-expert-bias and no router bias in the files: one error line
    naming the layer or MTP depth, nothing written (the untrained legacy fixture, its bias cut from
    both ranks)."""
    import shutil
    import signal

    from tests.convert.megatron.test_errors import edit_rank_file
    from tools.convert_checkpoint import main

    src = shutil.copytree(fixture_logits("deepseek_legacy_tp2")[0], tmp_path / "src")
    for rank in ("mp_rank_00", "mp_rank_01"):
        with torch.serialization.safe_globals([signal.Signals]):  # the saved args' exit signal
            edit_rank_file(
                str(src / "iter_0000003" / rank / "model_optim_rng.pt"),
                lambda state: state["model"].pop(cut),
            )
    assert main(["import-megatron", str(src), str(tmp_path / "ours"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and f"no expert_bias of {router}" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "ours")
