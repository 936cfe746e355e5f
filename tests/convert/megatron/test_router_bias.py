"""The router's learned bias against files megatron-core wrote: mixtral_bias_dist_ep2_distopt and
mixtral_bias_legacy_ep2_distopt (tests/fixtures/megatron, made by make_fixtures.py with
megatron-core 0.16.1: a 2-layer Mixtral-like MoE, 4 experts top-2, under Megatron's default
--add-bias-linear, trained 3 steps under EP2 with the distributed optimizer, so every router has
a bias ``[E]``, torch_dist ``decoder.layers.mlp.router.bias`` [layers, E]). Both import at
Megatron's logits into TP1 and TP2 in test_megatron_written.py with every fixture; here: into
the fixture's own EP2, the bias bit for bit, the legacy save's Adam state continuing Megatron's
run, the export's keys and shapes against the files megatron-core wrote, and (with megatron-core
installed, as test_export_megatron_core.py) Megatron loading our export at our logits."""

import os
import warnings

import pytest
import torch

from megatron_p2r.convert.megatron.exporter import export_megatron
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, LazyTensor, TorchArchive
from megatron_p2r.convert.reshard import Target
from tests.convert.megatron.megatron_written import ROOT, fixture_logits, loaded, logits_error

DIST, LEGACY = "mixtral_bias_dist_ep2_distopt", "mixtral_bias_legacy_ep2_distopt"
TRAIN = dict(lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant", clip_grad=0.0, weight_decay=0.01, train_iters=10)


def _dist_tensors(iter_dir: str, keys=None) -> dict:
    """The model tensors of a torch_dist checkpoint as PyTorch DCP reads them (not our reader):
    {key: tensor} for ``keys``, or {key: shape} of every model key when ``keys`` is None (the
    optimizer's and the RNG's left out)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(iter_dir)
    meta = reader.read_metadata().state_dict_metadata
    model = {  # Transformer Engine's _extra_state entries (bytes): None
        k: tuple(v.size) if hasattr(v, "size") else None
        for k, v in meta.items()
        if k.split(".")[0] in ("embedding", "decoder", "output_layer")
    }
    if keys is None:
        return model
    out = {k: torch.empty(model[k]) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _legacy_model(iter_dir: str) -> dict:
    """{rank directory: {model key: shape}} of a legacy checkpoint (``_extra_state`` left out)."""
    out = {}
    for rank in sorted(os.listdir(iter_dir)):
        model = TorchArchive(os.path.join(iter_dir, rank, "model_optim_rng.pt"), Kind.MEGATRON).obj["model"]
        out[rank] = {k: tuple(v.shape) for k, v in model.items() if isinstance(v, LazyTensor)}
    return out


def _megatrons_bias() -> torch.Tensor:
    """The routers' bias [layers, E] as megatron-core saved it."""
    iter_dir = os.path.join(fixture_logits(DIST)[0], "iter_0000003")
    return _dist_tensors(iter_dir, ["decoder.layers.mlp.router.bias"])["decoder.layers.mlp.router.bias"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{fixture: our TP1 import}."""
    root = tmp_path_factory.mktemp("router_bias")
    return {
        name: import_megatron(fixture_logits(name)[0], str(root / name), Target(1), progress=False)[0]
        for name in (DIST, LEGACY)
    }


def test_megatrons_router_bias_is_a_trained_fp32_vector_per_layer():
    """megatron-core's key and layout: one fp32 ``[E]`` per layer, stacked over the 2 layers, the
    seeded noise and 3 steps on it (no two entries equal, none 0)."""
    bias = _megatrons_bias()
    assert bias.shape == (2, 4) and bias.dtype == torch.float32
    assert bias.abs().min() > 0 and bias.flatten().unique().numel() == 8


@pytest.mark.parametrize("name", (DIST, LEGACY))
def test_the_router_bias_is_imported_bit_for_bit(imported, name):
    """Both saves of the run import every layer's router bias exactly as megatron-core saved it,
    and a run loading the import holds it."""
    from safetensors.torch import load_file

    ours = load_file(os.path.join(imported[name], "mp_rank_00_000_000.safetensors"))
    state = loaded(os.path.dirname(imported[name]), 2, None)
    for layer, bias in enumerate(_megatrons_bias()):
        assert torch.equal(ours[f"layers.{layer}.mlp.router.bias"], bias), layer
        assert torch.equal(state.model.layers[str(layer)].mlp.router.bias.detach(), bias), layer


def _ep2_error(rank, world, ckpt):
    """(max abs, rel) of this rank's logits: numbers, not tensors, cross the process boundary."""
    from tests.convert.megatron.megatron_written import our_logits

    return logits_error(our_logits(ckpt, fixture_logits(DIST)[1], world=world), fixture_logits(DIST)[2])


def test_the_import_into_the_fixtures_ep2_gives_megatrons_logits(tmp_path):
    """Imported into Megatron's own layout (EP2: each rank 2 of the 4 experts, the routers and
    their bias replicated), two gloo ranks compute Megatron's logits."""
    from tests.harness import run_distributed

    out = str(tmp_path / "ep2")
    import_megatron(fixture_logits(DIST)[0], out, Target(1, expert_parallel_size=2), progress=False)
    errors = run_distributed(_ep2_error, 2, out, timeout=300)
    print(f"\n{DIST} imported into EP2: max |logit difference| {errors[0][0]:.2g}, rel {errors[0][1]:.2g}")
    for error in errors:
        assert error[1] <= 1e-5, error


def test_a_megatron_run_continues_here_with_its_router_bias(imported):
    """The legacy save (its optimizer state is imported): one training step of ours on Megatron's
    4th batch (each of its 2 ranks had the batch) gives the logits Megatron's 4th step gave: the
    router bias's Adam moments are Megatron's. As in megatron-core (``_get_param_groups``: biases
    and 1-D parameters), it takes no weight decay (at 0.01 x LR the step's difference is below the
    logits' tolerance: the group is checked)."""
    from megatron_p2r.optim.optimizer import param_groups
    from megatron_p2r.training import train_step

    continued = torch.load(os.path.join(ROOT, DIST, "continued.pt"), weights_only=True)
    batch = torch.cat([continued["batch"]] * 2)
    state = loaded(os.path.dirname(imported[LEGACY]), batch.shape[0], None, **TRAIN)
    biases = {id(layer.mlp.router.bias) for layer in state.model.layers.values()}
    groups = param_groups(state.model, state.cfg.train)
    assert [g["weight_decay"] for g in groups if biases & {id(p) for p in g["params"]}] == [0.0]
    train_step(state, [{"tokens": batch[:, :-1], "labels": batch[:, 1:], "loss_mask": torch.ones(4, 16)}])
    with torch.no_grad():
        error = logits_error(state.model.eval()(tokens=continued["tokens"]).float(), continued["logits"])
    assert error[1] <= 1e-5, error


def test_the_export_has_megatron_cores_keys_and_shapes(imported, tmp_path):
    """The TP1 import exported back into Megatron's layout (EP2) has the model keys and shapes of
    the files megatron-core wrote, router bias included: torch_dist's global keys, and each legacy
    rank file's own."""
    ckpt = os.path.dirname(imported[DIST])
    out, _ = export_megatron(ckpt, str(tmp_path / "dist"), ep=2, save_optim=False, progress=False)
    theirs = _dist_tensors(os.path.join(fixture_logits(DIST)[0], "iter_0000003"))
    assert theirs["decoder.layers.mlp.router.bias"] == (2, 4)
    assert _dist_tensors(out) == theirs
    out, _ = export_megatron(ckpt, str(tmp_path / "legacy"), ckpt_format="torch", ep=2, progress=False)
    theirs = _legacy_model(os.path.join(fixture_logits(LEGACY)[0], "iter_0000003"))
    assert all(rank["decoder.layers.1.mlp.router.bias"] == (4,) for rank in theirs.values())
    assert _legacy_model(out) == theirs


def test_megatron_loads_the_export_with_our_logits(imported, tmp_path):
    """Megatron (megatron-core's own load_checkpoint, strict, 2 EP ranks) loads the export of the
    imported model and computes our logits on fixed tokens (strict: a router bias missing from the export is an error)."""
    from tests.convert.megatron.megatron_written import our_logits
    from tests.convert.megatron.test_export_megatron_core import _megatron_missing, _run_megatron

    if _megatron_missing():
        pytest.skip(
            "megatron-core and Megatron-LM's training code are not importable (P2R_MEGATRON_PYTHON, P2R_MEGATRON_LM)"
        )
    ckpt = os.path.dirname(imported[DIST])
    out, _ = export_megatron(ckpt, str(tmp_path / "megatron"), ep=2, save_optim=False, progress=False)
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    assert "successfully loaded checkpoint" in _run_megatron(
        out, tmp_path / "tokens.pt", tmp_path / "logits.pt", "torch_dist", 1, 2, 120
    )
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    ours = our_logits(ckpt, tokens)
    print(f"\nrouter bias export in Megatron EP=2: max |logit difference| {(theirs - ours).abs().max().item():.2g}")
    torch.testing.assert_close(theirs, ours[..., : theirs.shape[-1]], rtol=1e-5, atol=1e-5)
