"""Megatron-LM's flags: same names, same defaults; the others accepted, reported or refused
(config/megatron.py, arguments.py)."""

import os
import time

import pytest

from megatron_p2r.arguments import parse_launch, to_argv
from megatron_p2r.config.validation import validate
from megatron_p2r.config import Config, ConfigError
from megatron_p2r.config.schedule import schedule_plan
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import ExitSignal

BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]

# megatron/training/arguments.py at d98e8a64 (with its dataclass-generated flags): the default of
# every flag whose name is one of our fields and that has a default there. Ours must be the same.
MEGATRON_DEFAULTS = {
    "make_vocab_size_divisible_by": 128,
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "bias_gelu_fusion": True,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "untie_embeddings_and_output_weights": False,
    "disable_bias_linear": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "init_method_std": 0.02,
    "moe_layer_freq": 1,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_aux_loss_coeff": 0.0,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "distributed_timeout_minutes": 10,
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_decay_style": "linear",
    "optimizer": "adam",
    "weight_decay": 0.01,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
    "seed": 1234,
    "bf16": False,
    "fp16": False,
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "recompute_activations": False,
    "exit_signal_handler": False,
    "mock_data": False,
    "finetune": False,
    "log_interval": 100,
    "eval_iters": 100,
    # None there and here: unset
    "train_iters": None,
    "train_samples": None,
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_warmup_fraction": None,
    "decoupled_lr": None,
    "decoupled_min_lr": None,
    "rampup_batch_size": None,
    "step_batch_size_schedule": None,
    "global_batch_size": None,
    "exit_interval": None,
    "exit_duration_in_mins": None,
    "eval_interval": None,
    "num_experts": None,
    "moe_ffn_hidden_size": None,
    "ffn_hidden_size": None,
    "max_position_embeddings": None,
    "vocab_size": None,
    "tokenizer_type": None,
    # gpt-oss's options (megatron-core's TransformerConfig)
    "softmax_type": "vanilla",
    "quick_geglu": False,
    "glu_linear_offset": 0.0,
    "window_size": None,
    "window_attn_skip_freq": None,
    "activation_func_clamp_value": None,
    # the precision-aware optimizer (megatron-core's OptimizerConfig)
    "use_precision_aware_optimizer": False,
    "main_grads_dtype": "fp32",
    "main_params_dtype": "fp32",
    "exp_avg_dtype": "fp32",
    "exp_avg_sq_dtype": "fp32",
    "context_parallel_size": 1,
    "cp_comm_type": "p2p",
}


def test_defaults_are_megatrons():
    flat = {name: value for section in Config().to_dict().values() for name, value in section.items()}
    assert {name: flat[name] for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def test_no_effect_flags_are_reported_and_refused_flags_named():
    cfg, no_effect = parse_launch(
        BASE
        + [
            "--use-flash-attn",
            "--attention-backend",
            "flash",
            "--context-parallel-size",
            "1",
            "--moe-token-dispatcher-type",
            "allgather",
            "--calculate-per-token-loss",
        ]
    )
    assert [item.split(" (")[0] for item in no_effect] == [
        "--use-flash-attn",
        "--attention-backend",
        "--moe-token-dispatcher-type",
    ]
    assert cfg == parse_launch(BASE)[0]  # none of them changes the config
    with pytest.raises(ConfigError) as err:
        parse_launch(BASE + ["--hybrid-context-parallel", "--rotary-interleaved", "--use-flash-attn"])
    assert "--hybrid-context-parallel: hierarchical and hybrid context parallelism are not built" in str(err.value)
    assert "--rotary-interleaved: interleaved" in str(err.value) and "--use-flash-attn" not in str(err.value)


def test_value_dependent_statuses():
    with pytest.raises(ConfigError, match="--no-position-embedding: without --position-embedding-type rope"):
        parse_launch(BASE + ["--no-position-embedding"])
    assert parse_launch(BASE + ["--no-position-embedding", "--position-embedding-type", "rope"])[1] == []
    with pytest.raises(ConfigError, match="--moe-router-load-balancing-type sinkhorn: Sinkhorn routing is not built"):
        parse_launch(BASE + ["--moe-router-load-balancing-type", "sinkhorn"])
    with pytest.raises(ConfigError, match="--moe-router-score-function sqrtsoftplus: the sqrt"):
        parse_launch(BASE + ["--moe-router-score-function", "sqrtsoftplus"])
    # the gpt-oss script's: plain rope and fp32 routing are ours; ModelOpt's YaRN switch only acts on a load
    assert parse_launch(BASE + ["--rope-type", "rope", "--moe-router-dtype", "fp32"])[1] == []
    assert parse_launch(BASE + ["--enable-gpt-oss"])[1][0].startswith("--enable-gpt-oss (a ModelOpt flag")
    # multi-latent attention: YaRN (its default), or plain rope where YaRN's factor is 1 (the same tables)
    mla = BASE + ["--multi-latent-attention", "--rotary-scaling-factor", "4"]
    assert parse_launch(mla + ["--rope-type", "yarn"])[0].model.multi_latent_attention
    with pytest.raises(ConfigError, match="--rope-type rope is refused with --multi-latent-attention"):
        validate(parse_launch(mla + ["--rope-type", "rope"])[0], 1)  # a config field: checked with the others
    assert parse_launch(BASE + ["--multi-latent-attention", "--rope-type", "rope"])[1] == []
    with pytest.raises(ConfigError) as err:
        parse_launch(BASE + ["--moe-router-dtype", "fp64", "--enable-gpt-oss", "--load", "x"])
    for refused in (
        "--moe-router-dtype fp64: fp64 routing is not implemented",
        "--enable-gpt-oss: with a loaded ModelOpt checkpoint",
    ):
        assert refused in str(err.value)


def test_overlap_p2p_communication_is_on_by_default_as_in_megatron(tmp_path):
    """Megatron-LM (core_v0.16.1) has only --no-overlap-p2p-communication (store_false, dest
    overlap_p2p_comm): the overlap is on unless turned off. --overlap-p2p-communication, as older
    versions spell it, turns it back on; the last flag wins, and the command line wins over YAML."""
    interleaved = BASE + [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ]
    cfg, no_effect = parse_launch(interleaved)
    assert cfg.parallel.overlap_p2p_communication and schedule_plan(cfg).posts_receives_ahead
    assert no_effect == []
    off, no_effect = parse_launch(interleaved + ["--no-overlap-p2p-communication"])
    assert not schedule_plan(off).posts_receives_ahead and no_effect == []
    assert parse_launch(to_argv(off))[0] == off
    assert parse_launch(interleaved + ["--no-overlap-p2p-communication", "--overlap-p2p-communication"])[0] == cfg
    assert parse_launch(interleaved + ["--overlap-p2p-communication", "--no-overlap-p2p-communication"])[0] == off
    path = tmp_path / "off.yaml"
    path.write_text("no-overlap-p2p-communication: true\n")
    assert parse_launch(interleaved + ["--config", str(path)])[0] == off
    assert parse_launch(interleaved + ["--config", str(path), "--overlap-p2p-communication"])[0] == cfg


def test_overlap_p2p_communication_acts_only_with_interleaving():
    """Megatron-LM turns overlap_p2p_comm off without interleaving: asking for it there is
    reported as having no effect; turning it off is what happens anyway."""
    pipeline = BASE + ["--pipeline-model-parallel-size", "2"]
    cfg, no_effect = parse_launch(pipeline + ["--overlap-p2p-communication"])
    assert cfg == parse_launch(pipeline)[0] and not schedule_plan(cfg).posts_receives_ahead
    assert no_effect == ["--overlap-p2p-communication (without interleaved 1F1B (Megatron-LM turns it off too))"]
    assert parse_launch(pipeline + ["--no-overlap-p2p-communication"])[1] == []
    assert parse_launch(pipeline + ["--overlap-p2p-communication-warmup-flush"])[0] == cfg
    with pytest.raises(
        ConfigError,
        match="--overlap-p2p-communication-warmup-flush: needs the p2p overlap, which "
        "--no-overlap-p2p-communication turns off",
    ):
        parse_launch(pipeline + ["--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush"])


def test_yaml_takes_the_same_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "use-mcore-models: true\nmanual-gc: false\nempty-unused-memory-level: 1\n"
        "step-batch-size-schedule: 0:16 1K:32\nrampup-batch-size: [2, 2, 8]\n"
    )
    cfg, no_effect = parse_launch(BASE + ["--config", str(path)])
    assert [item.split(" (")[0] for item in no_effect] == ["--use-mcore-models", "--empty-unused-memory-level"]
    assert cfg.train.step_batch_size_schedule == ["0:16", "1K:32"] and cfg.train.rampup_batch_size == [2, 2, 8]
    path.write_text("empty-unused-memory-level: 3\n")
    with pytest.raises(ConfigError, match=r"key 'empty-unused-memory-level' must be one of \[0, 1, 2\], got 3"):
        parse_launch(BASE + ["--config", str(path)])


def test_gelu_flags_have_megatrons_meaning(tmp_path):
    """Megatron's default GELU MLP with biases computes tanh GELU (its fused bias-GELU kernel);
    --no-bias-gelu-fusion gives exact GELU, on the command line, in YAML under the flag or the
    field name, and back from to_argv; --openai-gelu, which megatron-core never reads, is
    reported and changes nothing."""
    cfg, no_effect = parse_launch(BASE)
    assert (cfg.model.bias_gelu_fusion, cfg.model.gelu_approximation, no_effect) == (True, "tanh", [])
    exact, no_effect = parse_launch(BASE + ["--no-bias-gelu-fusion"])
    assert (exact.model.bias_gelu_fusion, exact.model.gelu_approximation, no_effect) == (False, "none", [])
    assert "--no-bias-gelu-fusion" in to_argv(exact) and parse_launch(to_argv(exact))[0] == exact
    for line in ("no-bias-gelu-fusion: true", "bias-gelu-fusion: false"):
        (tmp_path / "c.yaml").write_text(line + "\n")
        assert parse_launch(BASE + ["--config", str(tmp_path / "c.yaml")])[0] == exact, line
    (tmp_path / "c.yaml").write_text("no-bias-gelu-fusion: false\n")
    assert parse_launch(BASE + ["--config", str(tmp_path / "c.yaml")])[0] == cfg
    openai, no_effect = parse_launch(BASE + ["--openai-gelu"])
    assert openai == cfg and [item.split(" (")[0] for item in no_effect] == ["--openai-gelu"]
    assert parse_launch(BASE + ["--openai-gelu", "--no-bias-gelu-fusion"])[0] == exact


def test_vocab_file_implies_gpt2_bpe_as_pretrain_gpt():
    cfg, _ = parse_launch(BASE + ["--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    cfg, _ = parse_launch(BASE + ["--vocab-file", "v.json", "--tokenizer-type", "HuggingFaceTokenizer"])
    assert cfg.data.tokenizer_type == "HuggingFaceTokenizer"
    assert parse_launch(BASE)[0].data.tokenizer_type is None


def test_exit_duration_counts_from_the_start():
    single = ParallelState.single()
    assert not ExitSignal(False, 1, started=time.monotonic() - 50).any_rank(single)
    assert ExitSignal(False, 1, started=time.monotonic() - 61).any_rank(single)
    assert not ExitSignal(False).any_rank(single)


def test_exit_signal_is_caught_by_name(tmp_path):
    """--exit-signal SIGUSR1 (Megatron-LM's enum, by name): the handler catches that signal."""
    import signal

    cfg, _ = parse_launch(BASE + ["--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save", str(tmp_path)])
    assert cfg.train.exit_signal == "SIGUSR1" and parse_launch(BASE)[0].train.exit_signal == "SIGTERM"
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        exit_signal = ExitSignal(True, signal_name=cfg.train.exit_signal)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exit_signal.any_rank(ParallelState.single())
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    """--save D --load D on an empty D starts from scratch; --exit-on-missing-checkpoint exits
    there with status 0 before training (Megatron-LM's sys.exit())."""
    from megatron_p2r.training import pretrain
    from tests.helpers import tiny_config

    cfg = tiny_config(
        train_iters=1, global_batch_size=2, save=str(tmp_path), load=str(tmp_path), exit_on_missing_checkpoint=True
    )
    with pytest.raises(SystemExit) as stop:
        pretrain(cfg)
    assert stop.value.code == 0 and os.listdir(tmp_path) == []
    assert f"--exit-on-missing-checkpoint: no checkpoint in {tmp_path}; exiting" in capsys.readouterr().out
