"""MTP with untied embeddings under PP2 and Megatron-LM checkpoints: gpt_dist_pp2_mtp_untied_distopt
(tests/fixtures/megatron, written by megatron-core 0.16.1 after 3 training steps under PP2 with the
distributed optimizer; its last stage holds a replica of the input embedding for the MTP depth, a
bucket of its own in that stage's grad buffer). test_megatron_written.py imports it into TP1 and
TP2 at Megatron's logits, reads its mains from the replayed buckets and continues Megatron's run
by one step of ours from the imported Adam state (PP1); here: into PP2 at Megatron's logits, the
MTP depth's loss, Megatron's 4th step continued under PP2, and the export loaded by Megatron
(skipped without megatron-core)."""

import os

import pytest
import torch

from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.reshard import Target
from megatron_p2r.model import mtp
from tests.convert.megatron.megatron_written import ROOT, fixture_logits, loaded, logits_error, our_logits

NAME = "gpt_dist_pp2_mtp_untied_distopt"
MEGATRON = torch.load(os.path.join(ROOT, NAME, "logits.pt"), weights_only=True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mtp_untied") / "ours")
    _, notes = import_megatron(fixture_logits(NAME)[0], out, Target(1), progress=False)
    return out, notes


def test_the_fixture_is_untied_mtp_under_pp2_with_the_distributed_optimizer(imported):
    flags = MEGATRON["flags"]
    assert {"--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "torch_dist"} <= set(flags)
    assert flags[flags.index("--mtp-num-layers") + 1] == "1"
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"
    assert any(note.startswith("optimizer: Adam's moments") for note in imported[1]), imported[1]


def test_the_import_gives_megatrons_logits_at_pp1(imported):
    error = logits_error(our_logits(imported[0], fixture_logits(NAME)[1]), fixture_logits(NAME)[2])
    print(f"\nimported into PP1: max |logit difference| {error[0]:.1e}, rel {error[1]:.1e}")
    assert error[1] <= 1e-5, error


def _pp2_error(rank, world, ckpt):
    """(max abs, rel) on the last stage: the first stage's hidden states sent on, the last stage's
    logits; numbers, not tensors, cross the process boundary."""
    import torch.distributed as dist

    tokens, megatron = fixture_logits(NAME)[1], fixture_logits(NAME)[2]
    state = loaded(ckpt, tokens.shape[0], world)
    with torch.no_grad():
        model = state.model.eval()
        if rank == 0:
            dist.send(model(tokens=tokens).contiguous(), dst=1)
            return None
        hidden = torch.empty(tokens.shape[0], tokens.shape[1], state.cfg.model.hidden_size)
        dist.recv(hidden, src=0)
        return logits_error(model(hidden=hidden).float(), megatron)


def test_the_import_gives_megatrons_logits_at_pp2(tmp_path):
    """Imported into PP2 (the MTP depth, the output layer and our replica of the embedding on the
    last stage), two gloo ranks compute Megatron's logits."""
    from tests.harness import run_distributed

    out = str(tmp_path / "pp2")
    import_megatron(fixture_logits(NAME)[0], out, Target(1, 2), progress=False)
    error = run_distributed(_pp2_error, 2, out, timeout=300)[1]
    print(f"\nimported into PP2: max |logit difference| {error[0]:.1e}, rel {error[1]:.1e}")
    assert error[1] <= 1e-5, error


def test_the_mtp_loss_is_megatrons(imported):
    """The MTP depth's loss on Megatron's tokens and labels (it reads the last stage's replica of
    the embedding in Megatron, the embedding here): as Megatron's tracker logged it."""
    state = loaded(imported[0], 2, None)
    tokens, labels = MEGATRON["tokens"], MEGATRON["mtp_labels"]
    state.model.eval()(tokens=tokens, labels=labels, loss_mask=torch.ones(labels.shape))
    ours = mtp.pop_losses(1, torch.device("cpu"), ())
    print(f"\nMTP loss: ours {float(ours[0]):.6f}, Megatron's {MEGATRON['mtp_loss'][0].item():.6f}")
    assert ours[0] == pytest.approx(MEGATRON["mtp_loss"][0].item(), rel=1e-5)


@pytest.mark.parametrize("pp", (1, 2))
def test_megatron_loads_the_export_at_our_logits(imported, tmp_path, pp):
    """The import exported back (torch_dist, written for PP1 and PP2: the embedding stored once,
    the MTP stage's replica not) loads in megatron-core (one rank, its strict load_checkpoint)
    and computes our logits (skipped without megatron-core, as test_export_megatron_core.py)."""
    from megatron_p2r.convert.megatron.exporter import export_megatron
    from tests.convert.megatron.test_export_megatron_core import _megatron_missing, _run_megatron

    if _megatron_missing():
        pytest.skip(
            "megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, P2R_MEGATRON_LM)"
        )
    out, _ = export_megatron(imported[0], str(tmp_path / "megatron"), pp=pp, progress=False)
    tokens = fixture_logits(NAME)[1]
    torch.save(tokens, tmp_path / "tokens.pt")
    vocab = loaded(imported[0], 2, None).cfg.model.vocab_size
    assert "successfully loaded checkpoint" in _run_megatron(
        out, tmp_path / "tokens.pt", tmp_path / "logits.pt", "torch_dist", 1, 1, vocab
    )
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    ours = our_logits(imported[0], tokens)
    print(f"\nexport for PP{pp} loaded by Megatron: max |logit difference| {logits_error(ours, theirs)[0]:.1e}")
    assert logits_error(ours, theirs)[1] <= 1e-5, logits_error(ours, theirs)
    assert logits_error(theirs, fixture_logits(NAME)[2])[1] <= 1e-5


def _pp2_continued_error(rank, world, ckpt, fresh):
    """(max abs, rel) on the last stage after one training step of ours under PP2 from the
    imported checkpoint (``fresh``: a new AdamW) on Megatron's 4th batch, against its logits."""
    import torch.distributed as dist

    from megatron_p2r.training import train_step

    continued = torch.load(os.path.join(ROOT, NAME, "continued.pt"), weights_only=True)
    batch, tokens = continued["batch"], continued["tokens"]
    flags = dict(lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant", clip_grad=0.0, weight_decay=0.01)
    state = loaded(ckpt, batch.shape[0], world, no_load_optim=fresh, train_iters=10, **flags)
    train_step(state, [{"tokens": batch[:, :-1], "labels": batch[:, 1:], "loss_mask": torch.ones(batch.shape[0], 16)}])
    with torch.no_grad():
        model = state.model.eval()
        if rank == 0:
            dist.send(model(tokens=tokens).contiguous(), dst=1)
            return None
        hidden = torch.empty(tokens.shape[0], tokens.shape[1], state.cfg.model.hidden_size)
        dist.recv(hidden, src=0)
        return logits_error(model(hidden=hidden).float(), continued["logits"])


def test_a_megatron_run_continues_here_under_pp2(tmp_path):
    """Imported into PP2 with Adam's state read from Megatron's buckets (each stage its own; our
    last stage's replica of the embedding as Megatron's), one training step of ours on 2 gloo
    ranks gives the logits Megatron's 4th step gave; with a fresh AdamW it does not."""
    from tests.harness import run_distributed

    out = str(tmp_path / "pp2")
    import_megatron(fixture_logits(NAME)[0], out, Target(1, 2), progress=False)
    resumed = run_distributed(_pp2_continued_error, 2, out, False, timeout=300)[1]
    fresh = run_distributed(_pp2_continued_error, 2, out, True, timeout=300)[1]
    print(f"\nMegatron's 4th step continued under PP2: rel {resumed[1]:.1e} (fresh AdamW: {fresh[1]:.1e})")
    assert resumed[1] <= 1e-5, resumed
    assert fresh[1] > 1e-3, fresh
