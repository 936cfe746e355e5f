"""import-megatron on checkpoints written by Megatron-LM's own code (tests/fixtures/megatron,
made by make_fixtures.py with megatron-core 0.16.1): each imports with the CLI into TP=1 and
TP=2 and gives the logits Megatron computed on the same tokens (rel 1e-5). megatron-core is not
needed: the checkpoints and Megatron's logits are committed files."""

import os

import pytest
import torch

from tests.convert.megatron.megatron_written import FIXTURES, ROOT, fixture_logits, imported_errors


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return imported_errors(str(tmp_path_factory.mktemp("imported")))


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("name", FIXTURES)
def test_import_gives_megatrons_logits(errors, name, tp):
    assert errors[(name, tp)][1] <= 1e-5, errors[(name, tp)]


def test_the_fixtures_cover_megatrons_layouts():
    """Both formats, TP > 1, PP > 1 (also with virtual pipeline chunks), EP > 1, bf16, optimizer
    state, the three model kinds, grouped-GEMM experts (GroupedMLP), gpt-oss's options
    (windows, sinks split over TP, clamped quick-GeGLU: dense and experts), multi-latent
    attention (both formats, TP2) and DeepSeek-V3's MoE and MTP (test_deepseek.py) are among the
    fixtures."""
    files = {name: os.listdir(os.path.join(fixture_logits(name)[0], "iter_0000003")) for name in FIXTURES}
    assert any("common.pt" in f for f in files.values()) and any("mp_rank_01" in f for f in files.values())
    assert any("mp_rank_00_001" in f for f in files.values())
    assert {"gpt", "llama", "mixtral", "gptoss", "mla", "deepseek"} == {name.split("_")[0] for name in FIXTURES}
    assert any("bf16" in name for name in FIXTURES) and any("_pp2" in name for name in FIXTURES)
    assert any("_vp2" in name for name in FIXTURES)
    assert any(os.path.isfile(os.path.join(ROOT, name, "adam_state.pt")) for name in FIXTURES)
    assert fixture_logits(FIXTURES[0])[2].dtype == torch.float32
    flags = {
        name: set(torch.load(os.path.join(ROOT, name, "logits.pt"), weights_only=True)["flags"]) for name in FIXTURES
    }
    assert all(any({"--moe-grouped-gemm", fmt} <= f for f in flags.values()) for fmt in ("torch", "torch_dist"))
    gpt_oss = {name: f for name, f in flags.items() if name.startswith("gptoss")}
    assert {"torch", "torch_dist"} <= set.union(*gpt_oss.values())
    for options in gpt_oss.values():
        assert {"--window-attn-skip-freq", "learnable", "--quick-geglu", "--activation-func-clamp-value"} <= options


# Saved after 3 Adam steps: the non-distributed optimizer in torch_dist and in legacy (its state
# lists); the distributed optimizer over 2 DP ranks in torch_dist (dp_reshardable: each DP rank's
# slice of its buckets; fully_reshardable: keyed like the model) and in legacy (distrib_optim.pt:
# flat buffers gathered on DP rank 0), in fp32 and in --bf16 (bf16 weights, fp32 mains)
WITH_OPTIMIZER = (
    "gpt_dist_tp1_adam",
    "gpt_legacy_tp1_adam",
    "gpt_dist_dp2_distopt",
    "gpt_dist_dp2_distopt_full",
    "gpt_legacy_dp2_distopt",
    "gpt_legacy_dp2_distopt_bf16",
)
# the distributed optimizer in torch_dist (dp_reshardable) under TP2 (each TP rank's buckets) and
# of an MoE model under EP2 (megatron-core's two chained optimizers: the dense parameters' buckets,
# and each EP rank's experts', GroupedMLP's and SequentialMLP's); no adam_state.pt, which
# make_fixtures assembles by parameter name under TP1 and EP1 only; under PP2 with 2 model chunks
# per rank (one grad buffer per chunk), trained by Megatron's interleaved schedule, in torch_dist
# and in legacy (distrib_optim.pt: one flat buffer per chunk); and GroupedMLP experts over 2 DP
# ranks in legacy (weight1/weight2 in the dense buffer under EP1); and the SequentialMLP run under
# EP2 in legacy (distrib_optim.pt: a list of the two chained optimizers' states); and MTP with an
# untied embedding under PP2 (the last stage's replica of the embedding a bucket of its own); and
# SequentialMLP experts with biases under EP2 (each expert's fc1 and fc2 weight, then bias; the
# router's bias in the dense buffer after its weight)
WITHOUT_ADAM_STATE = (
    "llama_dist_tp2_distopt",
    "mixtral_dist_ep2_grouped_distopt",
    "mixtral_dist_ep2_distopt",
    "gpt_dist_pp2_vp2_distopt",
    "gpt_legacy_pp2_vp2_distopt",
    "mixtral_legacy_dp2_grouped_distopt",
    "mixtral_legacy_ep2_distopt",
    "gpt_dist_pp2_mtp_untied_distopt",
    "mixtral_bias_dist_ep2_distopt",
)
# Megatron's 4th step of the --bf16 run computed in bf16: an fp32 step of ours differs by bf16's
# rounding (rel 1e-2), so the continued step is compared on the fp32 runs
CONTINUED_IN_FP32 = WITH_OPTIMIZER[:5] + WITHOUT_ADAM_STATE
# DeepSeek-V3's pieces under EP2 (test_deepseek.py continues it: its MTP router's bias is set by hand)
DEEPSEEK = ("deepseek_dist_ep2_distopt",)
# fixtures that are another's run saved another way (make_fixtures' same_run_as): that one's
# adam_state.pt and continued.pt hold what Megatron's optimizer had and did next
SAME_RUN_AS = {
    "gpt_dist_dp2_distopt_full": "gpt_dist_dp2_distopt",
    "gpt_legacy_pp2_vp2_distopt": "gpt_dist_pp2_vp2_distopt",
    "mixtral_legacy_ep2_distopt": "mixtral_dist_ep2_distopt",
}


def run_file(name: str, file: str) -> str:
    """``file`` (adam_state.pt, continued.pt) of the Megatron run fixture ``name`` was saved from."""
    run = SAME_RUN_AS.get(name, name)
    if run != name:  # the same run: the same weights, so Megatron's logits agree bit for bit
        assert torch.equal(fixture_logits(name)[2], fixture_logits(run)[2]), (name, run)
    return os.path.join(ROOT, run, file)


@pytest.mark.parametrize("name", WITH_OPTIMIZER)
def test_adam_state_is_megatrons(tmp_path, name):
    """The imported moments, step and fp32 mains (where saved apart from the weights) are the ones
    Megatron's optimizer held when it saved (adam_state.pt; the distributed optimizer's gathered
    from each rank's slices of each parameter, not from the flat buffer), tensor by tensor."""
    from safetensors.torch import load_file

    from megatron_p2r.convert.megatron.rules import megatron_name
    from tools.convert_checkpoint import main

    assert main(["import-megatron", fixture_logits(name)[0], str(tmp_path / "ours"), "--no-progress"]) == 0
    ours = load_file(str(tmp_path / "ours" / "iter_0000003" / "mp_rank_00_000_000.safetensors"))
    megatron = torch.load(run_file(name, "adam_state.pt"), weights_only=True)
    keys = [k for k in ours if not k.startswith("optimizer.")]
    assert sorted(megatron_name(k) for k in keys) == sorted(n for n in megatron if n != "step")
    for key in keys:
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[f"optimizer.{kind}.{key}"], megatron[megatron_name(key)][kind]), (kind, key)
        assert ours[f"optimizer.step.{key}"].item() == megatron["step"].item() == 3
        if "main" in megatron[megatron_name(key)]:
            assert torch.equal(ours[key], megatron[megatron_name(key)]["main"]), key


@pytest.mark.parametrize("name", ("gpt_dist_dp2_distopt", "gpt_dist_dp2_distopt_full") + WITHOUT_ADAM_STATE + DEEPSEEK)
def test_the_distributed_optimizers_mains_are_megatrons_weights(name):
    """The distributed optimizer (fp32 runs): each weight's fp32 main is the weight Megatron saved
    under its model key, bit for bit. dp_reshardable: read from its TP shards' places in Megatron's
    buckets (the weights carry seeded noise, so a misplaced slice cannot agree; the moments are read
    from the same places), so every TP rank's bucket layout is replayed right; fully_reshardable:
    under ``optimizer.state.param.<key>``; legacy: from each model chunk's flat buffer."""
    from megatron_p2r.convert.megatron.names import is_buffer
    from megatron_p2r.convert.megatron.source import open_megatron

    source = open_megatron(fixture_logits(name)[0])
    assert source.adam_step == 3.0
    assert getattr(source, "buckets", None) is None if "_legacy_" in name or name.endswith("_full") else source.buckets
    weights = {n for n in source.names if not is_buffer(n)}  # the routers' expert biases have no state
    assert set(source.optimizer["main"]) == weights
    for weight in weights:
        assert torch.equal(source.read(weight, "main"), source.read(weight)), weight
        assert (source.read(weight, "exp_avg_sq") > 0).any(), weight


@pytest.mark.parametrize("name", WITH_OPTIMIZER + WITHOUT_ADAM_STATE + DEEPSEEK)
def test_the_import_continues_at_megatrons_iteration(tmp_path, name):
    """--load of the import resumes where Megatron stopped: its iteration, consumed samples and
    LR-schedule position, so the next step takes the LR Megatron's 4th step took (3 steps into a
    5-iteration warm-up: 0 with a fresh schedule)."""
    from megatron_p2r.convert.megatron.importer import import_megatron
    from megatron_p2r.convert.reshard import Target
    from tests.convert.megatron.megatron_written import loaded

    out, _ = import_megatron(fixture_logits(name)[0], str(tmp_path / "ours"), Target(1), progress=False)
    megatron = torch.load(run_file(name, "continued.pt"), weights_only=True)["position"]
    assert os.path.basename(out) == "iter_0000003"
    batch = megatron["consumed_train_samples"] // megatron["iteration"]
    state = loaded(
        str(tmp_path / "ours"), batch, None, lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant", train_iters=10
    )
    assert (state.iteration, state.consumed_samples) == (3, megatron["consumed_train_samples"])
    assert state.scheduler.num_steps == megatron["scheduler_steps"]
    assert state.scheduler.lr == pytest.approx(megatron["lr"], rel=1e-6) and megatron["lr"] > 0


@pytest.mark.parametrize("name", CONTINUED_IN_FP32)
def test_a_megatron_run_continues_here(tmp_path, name):
    """From the imported step-3 checkpoint, one training step of ours on Megatron's 4th global
    batch (each DP rank of Megatron had the same batch; the same LR schedule, AdamW, weight decay,
    no clipping) gives the logits Megatron's own 4th step gave; the weights alone, with a fresh
    AdamW, do not."""
    from megatron_p2r.convert.megatron.importer import import_megatron
    from megatron_p2r.convert.reshard import Target
    from tests.convert.megatron.megatron_written import continued_logits, logits_error

    import_megatron(fixture_logits(name)[0], str(tmp_path / "ours"), Target(1), progress=False)
    megatron = torch.load(run_file(name, "continued.pt"), weights_only=True)
    position, batch = megatron["position"], megatron["batch"]
    replicas = position["consumed_train_samples"] // position["iteration"] // batch.shape[0]
    batch = torch.cat([batch] * replicas)
    flags = dict(
        lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant", clip_grad=0.0, weight_decay=0.01, train_iters=10
    )
    ours = logits_error(
        continued_logits(str(tmp_path / "ours"), batch, megatron["tokens"], **flags), megatron["logits"]
    )
    fresh = continued_logits(str(tmp_path / "ours"), batch, megatron["tokens"], no_load_optim=True, **flags)
    fresh = logits_error(fresh, megatron["logits"])
    print(
        f"\n{name} continued: max |logit difference| {ours[0]:.2g}, rel {ours[1]:.2g}; fresh AdamW rel {fresh[1]:.2g}"
    )
    assert ours[1] <= 1e-5, ours
    assert fresh[1] > 1e-3, fresh


def test_virtual_pipeline_optimizer_state_lists_are_named_as_not_read(tmp_path):
    """A virtual-pipeline checkpoint of the non-distributed optimizer (its state lists follow the
    parameters of all chunks, not mapped yet; made from the distributed one's rank files without
    their distrib_optim.pt) imports its weights only, and the note says why."""
    import shutil
    import signal
    from megatron_p2r.convert.megatron.importer import import_megatron
    from megatron_p2r.convert.reshard import Target
    from tests.convert.megatron.test_errors import edit_rank_file

    src = shutil.copytree(fixture_logits("gpt_legacy_pp2_vp2_distopt")[0], tmp_path / "src")
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        (src / "iter_0000003" / rank / "distrib_optim.pt").unlink()
        with torch.serialization.safe_globals([signal.Signals]):
            edit_rank_file(
                str(src / "iter_0000003" / rank / "model_optim_rng.pt"),
                lambda state: vars(state["args"]).update(use_distributed_optimizer=False),
            )
    out, notes = import_megatron(str(src), str(tmp_path / "ours"), Target(1), progress=False)
    note = next(n for n in notes if n.startswith("weights only"))
    assert "optimizer's state lists of virtual pipeline model chunks are not read yet" in note, note
    assert os.path.basename(out) == "iter_0000000"
