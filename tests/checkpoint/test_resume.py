"""Resume is bitwise: N steps + save + resume + N steps == 2N steps (CPU, fp32, dropout on); a
checkpoint resumes with or without --moe-grouped-gemm whichever it was saved with."""

import os

import pytest

from tests.harness import run_distributed
from tests.checkpoint.common import cfg_of, metadata, same_bytes, shard_files


def _straight_and_resumed(rank, world, root, cases):
    """For each case: 4 steps straight; 2 steps + exit (saves); resume + 2 steps."""
    from megatron_p2r.training import pretrain

    out = {}
    for name, values in cases.items():
        a, b = os.path.join(root, name, "a"), os.path.join(root, name, "b")
        straight = pretrain(cfg_of(save=a, **values))["losses"]
        first = pretrain(cfg_of(save=b, exit_interval=2, **values))["losses"]
        second = pretrain(cfg_of(load=b, save=b, **values))["losses"]
        out[name] = (straight, first, second)
    return out


DENSE = {"tp2": dict(tensor_model_parallel_size=2), "dp2": dict(global_batch_size=8)}
MOE = dict(
    num_layers=4,
    num_experts=4,
    moe_layer_freq=2,
    moe_ffn_hidden_size=24,
    moe_aux_loss_coeff=0.01,
    moe_input_jitter_eps=0.01,
    global_batch_size=4,
)
MOE_CASES = {"moe_pp2": dict(MOE, pipeline_model_parallel_size=2), "moe_ep2": dict(MOE, expert_model_parallel_size=2)}


def _check(results, tmp_path, cases) -> dict:
    """Assert bitwise resume for every case; return {case: shard file names}."""
    shards = {}
    for name in cases:
        straight, first, second = results[0][name]
        assert len(first) == 2 and len(second) == 2
        assert first + second == straight, name  # exact float equality
        a, b = tmp_path / name / "a" / "iter_0000004", tmp_path / name / "b" / "iter_0000004"
        files = shard_files(str(a))
        assert files == shard_files(str(b)) and len(files) >= 3
        for f in files:
            assert same_bytes(a / f, b / f), f"{name}: {f} differs between straight and resumed runs"
        ma, mb = metadata(str(a)), metadata(str(b))
        for field in ("iteration", "consumed_samples", "scheduler", "scaler", "tensors", "files", "p2r", "layout"):
            assert ma[field] == mb[field], field
        assert len([f for f in files if f.startswith("rng_and_data")]) == 2  # one RNG file per rank
        shards[name] = [f for f in files if f.startswith("mp_rank")]
    return shards


def test_dense_resume_is_bitwise(tmp_path):
    """TP=2 and DP=2 (2 ranks): losses of the resumed run equal the straight run's exactly, and
    the final checkpoints (weights, moments, RNG) are byte-identical."""
    results = run_distributed(_straight_and_resumed, 2, str(tmp_path), DENSE)
    shards = _check(results, tmp_path, DENSE)
    # one shard per (tp, pp, ep); the DP replicas split it into a part each (fully parallel save)
    assert shards["tp2"] == ["mp_rank_00_000_000.safetensors", "mp_rank_01_000_000.safetensors"]
    assert shards["dp2"] == ["mp_rank_00_000_000.rank_00000.safetensors", "mp_rank_00_000_000.rank_00001.safetensors"]


def test_moe_resume_is_bitwise(tmp_path):
    """MoE (aux loss, router jitter, dropout) with PP=2, and with EP=2: bitwise as above."""
    results = run_distributed(_straight_and_resumed, 2, str(tmp_path), MOE_CASES)
    layouts = _check(results, tmp_path, MOE_CASES)
    assert layouts["moe_pp2"] == ["mp_rank_00_000_000.safetensors", "mp_rank_00_001_000.safetensors"]
    # DP2: the dense pieces of shard 000 split between both ranks; the experts of EP rank 1 on rank 1
    assert layouts["moe_ep2"] == [
        "mp_rank_00_000_000.rank_00000.safetensors",
        "mp_rank_00_000_000.rank_00001.safetensors",
        "mp_rank_00_000_001.rank_00001.safetensors",
    ]


def _across_grouped_gemm(rank, world, root):
    """4 steps with the padded experts; 2 steps + save with grouped_mm experts, resumed without
    them for 2 more; and the other way round."""
    from megatron_p2r.training import pretrain

    out = {"straight": pretrain(cfg_of(**MOE))["losses"]}
    for saved_grouped in (True, False):
        path = os.path.join(root, f"saved_grouped_{saved_grouped}")
        first = pretrain(cfg_of(save=path, exit_interval=2, moe_grouped_gemm=saved_grouped, **MOE))["losses"]
        second = pretrain(cfg_of(load=path, save=path, moe_grouped_gemm=not saved_grouped, **MOE))["losses"]
        out[saved_grouped] = first + second
    return out


def test_checkpoint_does_not_depend_on_grouped_gemm(tmp_path):
    """The experts' parameters are the same with and without --moe-grouped-gemm: a checkpoint
    saved with it resumes without it and vice versa, on the losses of a run that never switched
    (rel 1e-5: grouped_mm sums the same products in another order)."""
    results = run_distributed(_across_grouped_gemm, 1, str(tmp_path))[0]
    for saved_grouped in (True, False):
        assert results[saved_grouped] == pytest.approx(results["straight"], rel=1e-5), saved_grouped
