"""Each split's own prefixes (--train-data-path ..., --per-split-data-args-path, --data-args-path)
serve the samples Megatron-LM's BlendedMegatronDatasetBuilder serves from the same prefixes:
tests/fixtures/megatron_per_split was written by megatron-core 0.16.1 itself (make_fixture.py)."""

import json
import os

import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.config import ConfigError
from megatron_p2r.config.validation import validate
from megatron_p2r.data.builder import build_train_valid_test_datasets

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron_per_split")
with open(os.path.join(HERE, "samples.json"), encoding="utf-8") as fh:
    FIXTURE = json.load(fh)
BASE = [
    "--vocab-size",
    str(FIXTURE["vocab_size"]),
    "--num-layers",
    "1",
    "--hidden-size",
    "8",
    "--num-attention-heads",
    "1",
    "--seq-length",
    str(FIXTURE["seq_length"]),
    "--seed",
    str(FIXTURE["seed"]),
]


def _located(words):
    return [os.path.join(HERE, w) if w in "abc" else w for w in words]


def _served(flags, samples, tmp_path):
    cfg = parse_args(BASE + flags + ["--data-cache-path", str(tmp_path / "cache")])
    datasets = build_train_valid_test_datasets(
        cfg.data, cfg.model.seq_length, cfg.train.seed, tuple(samples), cfg.model.vocab_size
    )
    return [
        [ds[k].tolist() for k in range(n)] if ds is not None else None for ds, n in zip(datasets, samples, strict=True)
    ]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda case: " ".join(case["flags"]))
def test_per_split_paths_serve_megatrons_samples(case, tmp_path):
    assert _served(_located(case["flags"]), case["samples"], tmp_path) == case["tokens"]


def test_per_split_json_file_is_the_same_as_the_flags(tmp_path):
    """Megatron's --per-split-data-args-path: each split a list, a string or null."""
    case = FIXTURE["cases"][1]  # train 0.3 a 0.7 c; valid b; no test
    path = tmp_path / "splits.json"
    path.write_text(
        json.dumps({"train": " ".join(_located(["0.3", "a", "0.7", "c"])), "valid": _located(["b"]), "test": None})
    )
    assert _served(["--per-split-data-args-path", str(path)], case["samples"], tmp_path) == case["tokens"]


def test_data_args_file_is_data_path(tmp_path):
    path = tmp_path / "blend.txt"
    path.write_text("\n".join(_located(["0.5", "a", "0.5", "b"])) + "\n")
    by_file = _served(["--data-args-path", str(path)], [10, 4, 0], tmp_path)
    assert by_file == _served(["--data-path", *_located(["0.5", "a", "0.5", "b"])], [10, 4, 0], tmp_path)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data-path", "x", "--train-data-path", "y"], "--data-path and per-split paths are mutually exclusive"),
        (["--data-path", "x", "--data-args-path", "y"], "--data-path and --data-args-path are mutually exclusive"),
        (["--mock-data", "--valid-data-path", "y"], "--mock-data and per-split paths are mutually exclusive"),
        (["--per-split-data-args-path", "p", "--train-data-path", "y"], "--per-split-data-args-path and --train"),
    ],
)
def test_one_way_to_give_the_data(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(BASE + flags), 1)


def test_a_bad_per_split_file_is_named(tmp_path):
    path = tmp_path / "splits.json"
    path.write_text('{"train": ["a"], "valid": 3, "test": null}')
    with pytest.raises(ConfigError, match=r"--per-split-data-args-path .*: 'valid' must be a list of strings"):
        _served(["--per-split-data-args-path", str(path)], [1, 1, 0], tmp_path)
    path.write_text('{"train": ["a"]}')
    with pytest.raises(ConfigError, match=r'expected \{"train": ..., "valid": ..., "test": ...\}'):
        _served(["--per-split-data-args-path", str(path)], [1, 1, 0], tmp_path)


def test_validation_without_validation_prefixes_is_an_error(tmp_path):
    with pytest.raises(
        ConfigError, match="4 valid samples are asked for .*: give --valid-data-path, or --eval-iters 0"
    ):
        _served(["--train-data-path", os.path.join(HERE, "a")], [2, 4, 0], tmp_path)
