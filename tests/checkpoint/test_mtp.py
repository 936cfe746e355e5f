"""Checkpoints of models with multi-token prediction (model/mtp.py): resume, TP/PP reshard,
delinking and depth growth (the depths are no layer module: copied as they are).

Tolerance: the resumed and resharded runs' losses rel 1e-5 (fp32; a change of layout changes the
order of reductions only); reshard round trips and delinked MTP pieces are compared bitwise.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_p2r.checkpoint.io import save_checkpoint
from megatron_p2r.convert.reshard import DelinkOptions, GrowOptions, Target, convert
from megatron_p2r.parallel.state import ParallelState
from tests.checkpoint.common import cfg_of, same_bytes, shard_files
from tests.harness import run_distributed
from tests.helpers import run_steps

MTP = dict(
    mtp_num_layers=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    num_layers=4,
    global_batch_size=4,
    hidden_dropout=0.0,  # run_steps does not restore the RNG streams a resume restores
    attention_dropout=0.0,
)
EH = "mtp.layers.1.eh_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp") / "a"
    _, state = run_steps(cfg_of(**MTP), ParallelState.single(), 2)
    save_checkpoint(str(root), state)
    return root


def test_resume_continues_the_uninterrupted_run(source):
    straight, _ = run_steps(cfg_of(**MTP), ParallelState.single(), 3)
    resumed, _ = run_steps(cfg_of(**MTP), ParallelState.single(), 1, load=str(source))
    assert resumed[0] == straight[2]


def test_reshard_round_trip_is_bitwise_and_splits_the_projection(source, tmp_path):
    b, a2 = tmp_path / "b", tmp_path / "a2"
    convert(str(source), str(b), Target(2, 2), progress=False)
    convert(str(b), str(a2), Target(1, 1), progress=False)
    full = load_file(str(source / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    assert full[EH].shape == (32, 64)
    for t in range(2):  # the last stage's files hold the depths, eh_proj split along its rows
        part = load_file(str(b / "iter_0000002" / f"mp_rank_0{t}_001_000.safetensors"))
        assert torch.equal(part[EH], full[EH][16 * t : 16 * t + 16])
        assert torch.equal(part["optimizer.exp_avg." + EH], full["optimizer.exp_avg." + EH][16 * t : 16 * t + 16])
        assert not any("mtp." in k for k in load_file(str(b / "iter_0000002" / f"mp_rank_0{t}_000_000.safetensors")))
    assert shard_files(str(a2 / "iter_0000002")) == ["mp_rank_00_000_000.safetensors"]
    assert same_bytes(
        source / "iter_0000002" / "mp_rank_00_000_000.safetensors",
        a2 / "iter_0000002" / "mp_rank_00_000_000.safetensors",
    )


def _resume(rank, world, path, overrides):
    losses, _ = run_steps(cfg_of(**MTP, **overrides), _initialized(cfg_of(**MTP, **overrides), world), 1, load=path)
    return losses


def _initialized(cfg, world):
    from megatron_p2r.layout.plan import ParallelPlan
    from megatron_p2r.parallel.state import initialize_plan

    return initialize_plan(ParallelPlan.for_world(cfg, world), torch.device("cpu"))


def test_a_tp2_reshard_resumes_at_the_one_process_loss(source, tmp_path):
    tp2 = tmp_path / "tp2"
    convert(str(source), str(tp2), Target(2, 1), progress=False)
    want, _ = run_steps(cfg_of(**MTP), ParallelState.single(), 1, load=str(source))
    for got in run_distributed(_resume, 2, str(tp2), dict(tensor_model_parallel_size=2)):
        assert got[0] == pytest.approx(want[0], rel=1e-5)


def test_delinking_copies_the_depths_as_they_are(tmp_path):
    pseudo = tmp_path / "pseudo"
    cfg = cfg_of(**MTP, p2r_phase="pseudo", share_pattern="all")
    _, state = run_steps(cfg, ParallelState.single(), 2)
    save_checkpoint(str(pseudo), state)
    real = tmp_path / "real"
    convert(str(pseudo), str(real), Target(1, 1), DelinkOptions(noise_std=0.01), progress=False)
    before = load_file(str(pseudo / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    after = load_file(str(real / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    depths = [k for k in before if "mtp." in k]
    assert len(depths) > 20 and all(torch.equal(before[k], after[k]) for k in depths)
    assert not torch.equal(before["layers.0.attention.qkv.weight"], after["layers.3.attention.qkv.weight"])
    assert os.path.exists(real / "iter_0000002" / "metadata.json")


def test_growth_copies_the_depths_as_they_are(source, tmp_path):
    """4 -> 8 layers: the depths (a layer of the last layer's kind, which growth keeps) unchanged."""
    grown = tmp_path / "grown"
    convert(str(source), str(grown), Target(1, 1), GrowOptions(num_layers=8), progress=False)
    before = load_file(str(source / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    after = load_file(str(grown / "iter_0000002" / "mp_rank_00_000_000.safetensors"))
    depths = [k for k in before if "mtp." in k]
    assert len(depths) > 20 and all(torch.equal(before[k], after[k]) for k in depths)
    assert torch.equal(after["layers.7.attention.qkv.weight"], before["layers.3.attention.qkv.weight"])
    losses, _ = run_steps(cfg_of(**{**MTP, "num_layers": 8}), ParallelState.single(), 1, load=str(grown))
    assert 3.0 < losses[0] < 8.0


def test_export_hf_refuses_the_depths_by_name(source, tmp_path):
    """transformers' Llama carries no MTP layers (export-megatron writes them: megatron-core's
    ``mtp.layers.D``; export-hf a DeepseekV3ForCausalLM's, tests/convert/hf/test_deepseek_v3_moe.py)."""
    from megatron_p2r.config import ConfigError
    from megatron_p2r.convert.hf.exporter import export_hf

    with pytest.raises(ConfigError, match="--mtp-num-layers 2 \\(multi-token prediction"):
        export_hf(str(source), str(tmp_path / "hf"), progress=False)


def _biases(model) -> dict:
    from megatron_p2r.moe.expert_bias import biased_routers

    return {name: router.expert_bias.tolist() for name, router in biased_routers(model).items()}


def test_the_depths_expert_bias_is_saved_grown_and_optional(tmp_path, capsys):
    """An MoE depth's router bias (--moe-router-enable-expert-bias) after 2 steps: saved under its
    own name beside the layers', loaded exactly, copied as it is by growth (the layers' from the
    layers growth copies); a checkpoint without it (written before the depths' biases were kept)
    loads with the depths' at 0, and says so."""
    from megatron_p2r.checkpoint.expert_bias import FIELD, bias_name, mtp_bias_name
    from megatron_p2r.checkpoint.metadata import read_metadata, write_metadata
    from megatron_p2r.checkpoint.io import load_checkpoint
    from megatron_p2r.training import build_train_state

    moe = dict(
        MTP,
        num_layers=2,
        num_experts=4,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
        moe_ffn_hidden_size=16,
        init_method_std=0.2,
    )
    _, state = run_steps(cfg_of(**moe), ParallelState.single(), 2)
    save_checkpoint(str(tmp_path / "a"), state)
    trained = _biases(state.model)
    depths = [mtp_bias_name(0), mtp_bias_name(1)]
    assert sorted(trained) == sorted([bias_name(0), bias_name(1), *depths])
    assert all(any(trained[n]) for n in depths)
    iter_dir = str(tmp_path / "a" / "iter_0000002")
    assert read_metadata(iter_dir)[FIELD] == trained

    def loaded(path, **values):
        state = build_train_state(cfg_of(**{**moe, **values}), ParallelState.single())
        load_checkpoint(path, state)
        return _biases(state.model)

    assert loaded(str(tmp_path / "a")) == trained
    convert(str(tmp_path / "a"), str(tmp_path / "grown"), Target(1, 1), GrowOptions(num_layers=4), progress=False)
    grown = read_metadata(str(tmp_path / "grown" / "iter_0000002"))[FIELD]
    assert {n: grown[n] for n in depths} == {n: trained[n] for n in depths}
    assert grown[bias_name(3)] == trained[bias_name(1)] and grown[bias_name(0)] == trained[bias_name(0)]
    assert loaded(str(tmp_path / "grown"), num_layers=4) == grown

    meta = read_metadata(iter_dir)
    meta[FIELD] = {n: v for n, v in meta[FIELD].items() if not n.startswith("mtp.")}
    write_metadata(iter_dir, meta)
    capsys.readouterr()
    older = loaded(str(tmp_path / "a"))
    assert "no expert bias saved for the MTP depths' routers" in capsys.readouterr().out
    assert all(not any(older[n]) for n in depths) and older[bias_name(1)] == trained[bias_name(1)]


UNTIED_PP2 = {"untied_pp2": dict(MTP, pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=True)}


def test_untied_pp2_resumes_bitwise_and_reshards_to_one_stage(tmp_path):
    """The last stage's replica of the untied input embedding (for the depths' lookups) is not
    stored: a PP2 checkpoint holds the embedding once (the first stage's), resumes bitwise (the
    replica reloaded from it, the distributed optimizer's state too), and reshards to PP1 with
    every tensor unchanged."""
    from tests.checkpoint.test_resume import _check, _straight_and_resumed

    cases = {k: dict(v, use_distributed_optimizer=True) for k, v in UNTIED_PP2.items()}
    _check(run_distributed(_straight_and_resumed, 2, str(tmp_path), cases), tmp_path, cases)
    pp2 = tmp_path / "untied_pp2" / "b"
    stored = {}
    for f in shard_files(str(pp2 / "iter_0000004")):
        if f.startswith("mp_rank"):
            part = load_file(str(pp2 / "iter_0000004" / f))
            assert not any("embedding_replica" in k for k in part), f
            assert ("embedding.word_embeddings.weight" in part) == f.startswith("mp_rank_00_000"), f
            stored.update(part)
    one = tmp_path / "one"
    convert(str(pp2), str(one), Target(1, 1), progress=False)
    merged = load_file(str(one / "iter_0000004" / "mp_rank_00_000_000.safetensors"))
    assert merged.keys() == stored.keys()
    assert all(torch.equal(merged[k], stored[k]) for k in merged)


def test_untied_delinking_into_pp2_resumes_at_the_one_stage_loss(tmp_path):
    """A pseudo checkpoint delinked into PP2: the last stage's embedding replica is loaded from the
    delinked embedding (nothing of it stored), so PP2 resumes at the loss PP1 resumes at."""
    untied = dict(MTP, p2r_phase="pseudo", share_pattern="all", untie_embeddings_and_output_weights=True)
    pseudo = tmp_path / "pseudo"
    _, state = run_steps(cfg_of(**untied), ParallelState.single(), 2)
    save_checkpoint(str(pseudo), state)
    real = {"real": dict(untied, p2r_phase="real")}
    for pp in (1, 2):
        convert(str(pseudo), str(tmp_path / f"pp{pp}"), Target(1, pp), DelinkOptions(noise_std=0.01), progress=False)
    for f in shard_files(str(tmp_path / "pp2" / "iter_0000002")):
        assert not any("embedding_replica" in k for k in load_file(str(tmp_path / "pp2" / "iter_0000002" / f))), f
    want, _ = run_steps(cfg_of(**real["real"]), ParallelState.single(), 1, load=str(tmp_path / "pp1"))
    pp2 = dict(real["real"], pipeline_model_parallel_size=2)
    for got in run_distributed(_resume, 2, str(tmp_path / "pp2"), {k: v for k, v in pp2.items() if k not in MTP}):
        assert got[0] == pytest.approx(want[0], rel=1e-5)
