"""Megatron-LM's example launch scripts run unchanged (docs/megatron.md).

Each fixture in ``tests/fixtures/megatron_scripts/`` is the argv a script hands to
``pretrain_gpt.py`` (``tools/megatron_flags.py extract``). Its paths are pointed at tiny data
made here, and the sizes are shrunk by appending the same flags, as a user would (later flags
win); then ``pretrain_m6.main`` trains 2 iterations on CPU, one launch per script.
"""

import importlib.util
import json
import os
import re

import pytest

from megatron_p2r.arguments import all_fields, field_flags, flag_statuses, parse_launch
from megatron_p2r.config.megatron import MEGATRON_FLAGS, NO_EFFECT
from tests.data.test_tokenizers import TRAIN_TEXTS, bpe_files, sp_model  # noqa: F401 (fixtures)
from tests.reliability.common import launch
from tools import megatron_flags, preprocess_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_scripts")
SCRIPTS = [
    "gpt3_175b",
    "gptoss",
    "llama3_8b",
    "llama3_8b_data",
    "llama3_8b_fsdp",
    "mixtral_8x7b",
]  # as the shell globs them
# The same flags again, small: 2 iterations of a model of hidden 32-64 on CPU.
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
]
SHRINK = {
    "gpt3_175b": SMALL
    + [
        "--max-position-embeddings",
        "32",
        "--train-iters",
        "2",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
    ],
    "llama3_8b": SMALL
    + [
        "--ffn-hidden-size",
        "128",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--max-position-embeddings",
        "32",
        "--vocab-size",
        "256",
        "--global-batch-size",
        "4",
        "--train-samples",
        "8",
        "--lr-decay-samples",
        "8",
        "--lr-warmup-samples",
        "2",
    ],
    "mixtral_8x7b": SMALL
    + [
        "--ffn-hidden-size",
        "128",
        "--num-query-groups",
        "2",
        "--max-position-embeddings",
        "64",
        "--num-experts",
        "4",
        "--pipeline-model-parallel-size",
        "1",
        "--expert-model-parallel-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--split",
        "90,8,2",
    ],  # 99990,8,2 gives no document of the tiny corpus to validation
    # its own --eval-iters 0 kept; a window shorter than the sequence; 2 ranks of EP 2 instead of PP 8
    "gptoss": [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "128",
        "--moe-ffn-hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--vocab-size",
        "256",
        "--window-size",
        "7,0",
        "--pipeline-model-parallel-size",
        "1",
        "--expert-model-parallel-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-samples",
        "8",
        "--lr-decay-samples",
        "8",
        "--log-interval",
        "1",
    ],
}
RANKS = {"gpt3_175b": 2, "llama3_8b": 1, "mixtral_8x7b": 2, "gptoss": 2}


def fixture(name: str) -> dict:
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def config_fields() -> set:
    return {flag for _, f in all_fields() for flag in field_flags(f)}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_scripts_has_a_status(name):
    unknown = [flag for flag, _, status, _ in flag_statuses(fixture(name)["argv"]) if status == "unknown"]
    assert unknown == []


def test_table_flags_are_config_fields_exactly_when_marked():
    fields = config_fields()
    assert [flag for flag, entry in MEGATRON_FLAGS.items() if entry.config_field != (flag in fields)] == []


@pytest.mark.parametrize("tp, reported", [(1, True), (2, False)])
def test_sequence_parallel_has_no_effect_with_one_tensor_parallel_rank(tp, reported):
    argv = [
        "--mock-data",
        "--vocab-size",
        "128",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--tensor-model-parallel-size",
        str(tp),
        "--sequence-parallel",
    ]
    cfg, no_effect = parse_launch(argv)
    assert cfg.parallel.sequence_parallel
    assert any(line.startswith("--sequence-parallel (") for line in no_effect) == reported
    assert [status for flag, _, status, _ in flag_statuses(argv) if flag == "--sequence-parallel"] == [
        NO_EFFECT if reported else "meaning"
    ]


def test_docs_table_and_counts_are_the_tables():
    fixtures = [fixture(name) for name in SCRIPTS]
    with open(os.path.join(ROOT, "docs", "megatron.md"), encoding="utf-8") as fh:
        docs = fh.read()
    assert megatron_flags.table(fixtures) in docs
    assert megatron_flags.count_table(fixtures) in docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for text in TRAIN_TEXTS:
            fh.write(json.dumps({"text": text}) + "\n")
    return str(path)


def preprocessed(corpus: str, out: str, *tokenizer: str) -> str:
    assert preprocess_data.main(["--input", corpus, "--output-prefix", out, "--append-eod", *tokenizer]) == 0
    return out + "_text_document"


def script_argv(name: str, paths: dict) -> list:
    """The fixture's argv with its placeholders filled in."""
    argv = []
    for arg in fixture(name)["argv"]:
        for key, value in paths.items():
            arg = arg.replace("{" + key + "}", value)
        argv.append(arg)
    return argv


def run_script(name: str, tmp_path, paths: dict, env=None):
    """Launch the script's argv (placeholders filled in) plus its shrink flags; return (log records,
    output of rank 0)."""
    log = tmp_path / "log.jsonl"
    paths = {
        "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
        "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
        "WORKDIR": str(tmp_path),
        **paths,
    }
    results = launch(
        script_argv(name, paths) + SHRINK[name] + ["--log-file", str(log), "--device", "cpu"],
        RANKS[name],
        env=env,
        out_dir=str(tmp_path),
        timeout=300,
    )
    assert [code for code, _ in results] == [0] * RANKS[name], results[0][1][-3000:]
    records = [json.loads(line) for line in open(log, encoding="utf-8") if "lm_loss" in line]
    assert [r["iteration"] for r in records] == [1, 2]
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt", encoding="utf-8") as fh:
        assert fh.read().strip() == "2"
    assert all("no effect here" not in out for _, out in results[1:])  # reported once, by rank 0
    return records, results[0][1]


def reported_no_effect(name: str, output: str) -> None:
    """One "no effect here" line on rank 0, naming exactly the flags the table says."""
    expected = sorted(flag for flag, _, status, _ in flag_statuses(fixture(name)["argv"]) if status == NO_EFFECT)
    lines = [line for line in output.splitlines() if line.startswith("no effect here: ")]
    assert len(lines) == 1
    assert sorted(re.findall(r"(?:: |; )(--[a-z0-9-]+) \(", lines[0])) == expected


def test_gpt3_175b_script(tmp_path, corpus, bpe_files):  # noqa: F811
    vocab, merges = bpe_files
    data = preprocessed(
        corpus,
        str(tmp_path / "gpt"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
    )
    records, output = run_script("gpt3_175b", tmp_path, {"VOCAB_FILE": vocab, "MERGE_FILE": merges, "DATA_PATH": data})
    # the step schedule's first batch (16 until 2.4B tokens), on 2 pipeline stages
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in records] == [(16, 16), (16, 32)]
    reported_no_effect("gpt3_175b", output)


def test_llama3_8b_script(tmp_path):
    records, output = run_script("llama3_8b", tmp_path, {})
    assert [r["consumed_samples"] for r in records] == [4, 8]  # --train-samples 8 in batches of 4
    reported_no_effect("llama3_8b", output)


def test_mixtral_8x7b_script(tmp_path, corpus, sp_model):  # noqa: F811
    """Its W&B branch (WANDB_API_KEY set) logs offline where wandb is installed; elsewhere wandb's
    own WANDB_MODE=disabled turns W&B off."""
    wandb_installed = importlib.util.find_spec("wandb") is not None
    env = {"WANDB_MODE": "offline" if wandb_installed else "disabled", "WANDB_CONSOLE": "off"}
    data = preprocessed(
        corpus, str(tmp_path / "mix"), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model
    )
    records, output = run_script("mixtral_8x7b", tmp_path, {"TOKENIZER_MODEL": sp_model, "DATA_PATH": data}, env)
    assert all(r["moe_aux_loss"] > 0 for r in records)
    reported_no_effect("mixtral_8x7b", output)
    assert bool(list((tmp_path / "ckpt" / "wandb").glob("wandb/offline-run-*"))) == wandb_installed


def test_gptoss_script(tmp_path):
    """Sliding windows on every other layer, learned sinks, clamped quick-GeGLU experts, and
    --eval-iters 0: no validation at all (its --eval-interval would never come anyway)."""
    records, output = run_script("gptoss", tmp_path, {})
    assert [r["consumed_samples"] for r in records] == [4, 8]
    assert "validation" not in output
    reported_no_effect("gptoss", output)


def test_megatron_fsdp_script_is_refused_by_name(tmp_path):
    """Every flag is known; --use-megatron-fsdp alone is refused, with why and what to do."""
    from megatron_p2r.arguments import parse_launch
    from megatron_p2r.config import ConfigError

    argv = script_argv(
        "llama3_8b_fsdp",
        {
            "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
            "WORKDIR": str(tmp_path),
            "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
        },
    )
    with pytest.raises(ConfigError) as refused:
        parse_launch(argv)
    assert str(refused.value).startswith(
        "not supported here (docs/megatron.md): --use-megatron-fsdp: Megatron-FSDP shards gradients and 16-bit weights"
    )


def test_extract_stands_in_for_both_launchers(tmp_path):
    """``extract`` records what follows the training script under ``torchrun`` and ``python -m
    torch.distributed.run`` (gpt-oss, FSDP), makes the directories a script insists on, and
    writes the directory it runs in as {WORKDIR}."""
    script = tmp_path / "train.sh"
    script.write_text(
        '#!/bin/bash\n[ -d "$1" ] || exit 1\nARGS=(--num-layers 2 "--split \'99,1,0\'")\n'
        'python -c "pass"\n'  # any other python runs as itself
        "$LAUNCH pretrain_gpt.py ${ARGS[@]} --save $1 --data-cache-path ${PWD}/cache\n"
    )
    want = ["--num-layers", "2", "--split", "'99,1,0'", "--save", "ckpt", "--data-cache-path", "{WORKDIR}/cache"]
    for launcher in ("torchrun --nproc_per_node 8", "python -m torch.distributed.run --nproc_per_node 8"):
        assert megatron_flags.extract(str(script), ["ckpt"], {"LAUNCH": launcher}, dirs=["ckpt"]) == want
