"""Every config value checked for type and range before anything is built (config/ranges.py and
the RANGES table beside each section); YAML read by the strict loader."""

import dataclasses

import pytest

from megatron_p2r.arguments import load_yaml, parse_args
from megatron_p2r.config import SECTIONS, Config, ConfigError, check_values
from megatron_p2r.config.ranges import numeric_fields_without_range
from megatron_p2r.config.validation import RANGE_TABLES


def test_every_numeric_field_of_every_section_has_a_range():
    assert set(RANGE_TABLES) == set(SECTIONS)
    missing = {name: numeric_fields_without_range(cls, RANGE_TABLES[name]) for name, cls in SECTIONS.items()}
    assert not any(missing.values()), f"add these fields to their section's RANGES table: {missing}"


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(lr=float("nan")), "--lr must be a finite number, got nan"),
        (dict(adam_beta1=1.5), "--adam-beta1 must be < 1, got 1.5 (range [0, 1))"),
        (dict(make_vocab_size_divisible_by=0), "--make-vocab-size-divisible-by must be >= 1, got 0"),
        (dict(rotary_base=0.0), "--rotary-base must be > 0, got 0.0"),
        (dict(lr_decay_iters=-5), "--lr-decay-iters must be >= 1, got -5"),
        (dict(weight_decay=-0.1), "--weight-decay must be >= 0, got -0.1"),
        (dict(num_layers=1000000), "--num-layers must be <= 4096, got 1000000"),
        (dict(hidden_size=1000000), "--hidden-size must be <= 262144, got 1000000"),
        (dict(tensor_model_parallel_size=10**9), "--tensor-model-parallel-size must be <= 8192"),
        (dict(hidden_size="32"), "--hidden-size expects int, got '32' (str)"),
        (dict(swiglu=1), "--swiglu expects bool, got 1 (int)"),
        (dict(num_layers=True), "--num-layers expects int, got True (bool)"),
        (dict(save="a\x00b"), "--save must not contain a NUL character"),
        (dict(data_path=["a", 3]), "--data-path expects str, got 3 (int)"),
        (dict(normalization="BatchNorm"), "--normalization must be one of"),
        (dict(ddp_bucket_size=0), "--ddp-bucket-size must be >= 1, got 0"),
        (dict(num_query_groups=0), "--num-query-groups must be >= 1, got 0"),
        (dict(rotary_percent=0.0), "--rotary-percent must be > 0, got 0.0 (range (0, 1])"),
        (dict(train_samples=-1), "--train-samples must be >= 0, got -1"),
        (dict(lr_warmup_fraction=1.0), "--lr-warmup-fraction must be < 1, got 1.0 (range [0, 1))"),
        (dict(decoupled_lr=float("inf")), "--decoupled-lr must be a finite number, got inf"),
        (dict(hysteresis=0), "--hysteresis must be >= 1, got 0"),
        (dict(exit_duration_in_mins=0), "--exit-duration-in-mins must be >= 1, got 0"),
        (dict(rampup_batch_size=[4, 4]), "--rampup-batch-size expects 3 values, got 2"),
        (dict(rampup_batch_size=[4, -4, 100]), "--rampup-batch-size must be >= 0, got -4"),
    ],
)
def test_a_value_of_the_wrong_type_or_out_of_range_is_one_message(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_values(Config().replace(**values))


def test_parse_args_checks_every_value():
    with pytest.raises(ConfigError, match="--adam-beta2 must be < 1"):
        parse_args(["--adam-beta2", "1.0"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("num-layers: 2\nnum-layers: 3\n", "c.yaml:2: key 'num-layers' is given twice"),
        ("a: &x [1, 2]\nhidden-size: *x\n", "c.yaml:2: YAML aliases"),
        ("lr: " + "[" * 100 + "]" * 100 + "\n", "nested deeper than 32 levels"),
        ("lr: .nan\n", "--lr must be a finite number"),
        (b"lr: \xff\n", "not UTF-8 text"),
    ],
)
def test_the_yaml_loader_refuses_aliases_duplicates_and_depth(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=message):
        parse_args(["--config", str(path)])


def test_an_alias_bomb_of_real_flags_is_refused_before_it_expands(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 20)]
    lines.append("data-path: *a19")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines))
    with pytest.raises(ConfigError, match="aliases"):
        load_yaml(str(tmp_path / "bomb.yaml"))


def test_a_section_field_added_without_a_range_would_be_caught():
    @dataclasses.dataclass(frozen=True)
    class Section:
        steps: int = 1
        rate: float = 0.1
        name: str = "x"

    assert numeric_fields_without_range(Section, {"steps": None}) == ["rate"]
