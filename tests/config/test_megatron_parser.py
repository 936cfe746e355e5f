"""Every flag of Megatron-LM's own parser has a status here (docs/megatron.md).

``megatron_p2r/config/megatron_parser.json`` is Megatron-LM's ``add_megatron_arguments`` at
core_v0.16.1 written down by ``tools/megatron_parser.py`` (run with megatron-core installed); the
tests need only the committed table.
"""

import json
import os

import pytest

from megatron_p2r.arguments import all_fields, build_parser, field_flags, flag_statuses, parse_launch
from megatron_p2r.config import ConfigError
from megatron_p2r.config.fields import field_default
from megatron_p2r.config.megatron import MEGATRON_FLAGS, STATUSES, UNBUILT_VALUES, megatron_parser
from megatron_p2r.config.megatron_families import FAMILIES
from tools import megatron_flags

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "megatron_scripts")

BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
TABLE = megatron_parser()
PARSER = build_parser()
MEGATRON = [flag for action in TABLE["actions"] for flag in action["flags"]]
# Config fields whose default is not Megatron-LM's, on purpose: Megatron requires the sizes (None
# there) where a bare `pretrain_m6.py` trains a small demo; the backend follows the device.
DEVIATIONS = {
    "--num-layers": 4,
    "--hidden-size": 256,
    "--num-attention-heads": 4,
    "--seq-length": 256,
    "--micro-batch-size": 4,
    "--lr": 3e-4,
    "--distributed-backend": "auto",
    "--moe-z-loss-coeff": 0.0,  # None there: no z-loss, as 0.0 here
    "--split": "969,30,1",
    "--cp-comm-type": "p2p",  # ["p2p"] there: one type per layer; one for every layer here
}  # None there, set to "969, 30, 1" by validate_args without per-split paths


def test_the_table_is_megatrons_parser_at_the_followed_revision():
    assert TABLE["revision"] == "core_v0.16.1" and TABLE["flags"] == len(MEGATRON) == len(set(MEGATRON)) == 680


def test_every_megatron_flag_is_known():
    """0 of Megatron's flags is an "unrecognized argument": each is a config field (Megatron's
    meaning) or an entry of config/megatron.py, with one of the three statuses."""
    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    fields = {flag for _, f in all_fields() for flag in field_flags(f)}
    assert [flag for flag in MEGATRON if flag not in known] == []
    assert [flag for flag in MEGATRON if flag not in fields and flag not in MEGATRON_FLAGS] == []
    assert {entry.status for entry in MEGATRON_FLAGS.values()} <= set(STATUSES)


def test_families_name_only_megatron_flags_once_and_no_field():
    named = [flag for _, _, flags in FAMILIES for flag in flags]
    fields = {flag for _, f in all_fields() for flag in field_flags(f)}
    assert len(named) == len(set(named))
    assert [flag for flag in named if flag not in MEGATRON or flag in fields] == []
    assert {status for status, _, _ in FAMILIES} <= set(STATUSES)


# Flags whose Megatron parser takes any string but whose Megatron code takes only these values
# (here they are choices, checked at parse time).
WORKING_VALUES = {"tiktoken_pattern": "v2"}


def _sample(action: dict) -> list:
    """A value Megatron's parser would take for the action (its default when it has one)."""
    if action["action"] != "store":
        return []
    default = action["default"]
    if action["dest"] in WORKING_VALUES:
        return [WORKING_VALUES[action["dest"]]]
    if action["choices"]:
        value = default if default in action["choices"] else action["choices"][0]
    else:
        value = default if default is not None else {"float": 0.5}.get(action["type"], 2)
    count = action["nargs"] if isinstance(action["nargs"], int) else 1
    values = (value or [2] * count) if isinstance(value, list) else [value] * count
    return [str(v) for v in values] if action["nargs"] != 0 else []


@pytest.mark.parametrize("action", TABLE["actions"], ids=lambda action: action["flags"][0])
def test_each_flag_parses_as_megatrons_and_has_a_status(action):
    """Given as Megatron's parser takes it, each spelling parses, and has a status; a refused one
    stops with an error that names it, the others train."""
    for flag in action["flags"]:
        argv = [flag, *_sample(action)]
        status = [row for row in flag_statuses(BASE + argv) if row[0] == flag][0][2]
        assert status in STATUSES, (argv, status)
        PARSER.parse_args(BASE + argv)  # argparse exits on a value it does not take
        if status == "refused":
            with pytest.raises(ConfigError, match=flag.replace("_", "-")):
                parse_launch(BASE + argv)


def test_a_refused_flag_at_megatrons_default_asks_for_nothing():
    assert parse_launch(BASE + ["--weight-decay-incr-style", "constant"])[1] == []
    with pytest.raises(ConfigError, match="--weight-decay-incr-style linear: "):
        parse_launch(BASE + ["--weight-decay-incr-style", "linear"])


def test_megatrons_other_spellings_set_the_same_field():
    assert parse_launch(BASE + ["--persistent-save-interval", "7"])[0].checkpoint.save_interval == 7
    capacity = ["--num-experts", "4", "--moe-expert-capacity-factor", "0.5"]  # a field named here first
    assert parse_launch(BASE + capacity)[0].model.moe_capacity_factor == 0.5
    cfg = parse_launch(BASE + ["--disable-ckpt-fully-parallel-save"])[0]
    assert (
        cfg == parse_launch(BASE + ["--no-ckpt-fully-parallel-save"])[0] and not cfg.checkpoint.ckpt_fully_parallel_save
    )


def test_config_fields_have_megatrons_defaults():
    """Every config field that is a flag of Megatron's parser has its default there (a switch:
    off unless given), except the deliberate deviations above."""
    actions = {flag: action for action in TABLE["actions"] for flag in action["flags"]}
    differ = {}
    for _, f in all_fields():
        action = actions.get(field_flags(f)[0])
        if action is None:
            continue
        if action["action"] in ("store_true", "store_false"):
            if f.default not in (False, True):
                differ[field_flags(f)[0]] = f.default
        elif action["default"] != field_default(f) and not (action["default"] is None and f.default is False):
            differ[field_flags(f)[0]] = field_default(f)
    assert differ == DEVIATIONS


# Flags newer than the parser table, with Megatron-LM's defaults at the revision its example
# scripts come from (NVIDIA/Megatron-LM@d98e8a64, megatron/training/arguments.py).
NEWER = {"--lion-beta1": 0.95, "--lion-beta2": 0.98}


def test_newer_megatron_flags_have_its_defaults():
    fields = {field_flags(f)[0]: f.default for _, f in all_fields()}
    assert {flag: fields[flag] for flag in NEWER} == NEWER


def test_megatrons_other_values_of_a_field_are_refused_by_name():
    """A value Megatron's parser takes for a config field's flag and this framework does not build
    is refused with its reason (not argparse's "invalid choice")."""
    actions = {flag: action for action in TABLE["actions"] for flag in action["flags"]}
    for _, f in all_fields():
        action = actions.get(field_flags(f)[0])
        if action and action["choices"]:
            unbuilt = set(action["choices"]) - set(f.metadata.get("choices") or ())
            assert unbuilt <= set(UNBUILT_VALUES.get(field_flags(f)[0], ())), field_flags(f)[0]
    for optimizer in ("sgd", "muon", "dist_muon", "adaptive_muon", "soap"):
        with pytest.raises(ConfigError, match=f"--optimizer {optimizer}: .* not built"):
            parse_launch(BASE + ["--optimizer", optimizer])


def test_the_fsdp_scripts_other_branches_parse():
    """The Llama-3 8B FSDP script with NSYS_PROFILE=1, USE_UV=1, USE_MEGATRON_FSDP=0 and a corpus
    (the branches tests/fixtures/megatron_scripts/llama3_8b_fsdp.json does not take): 0 unknown,
    and without --use-megatron-fsdp nothing is refused."""
    with open(os.path.join(FIXTURES, "llama3_8b_fsdp_nsys.json"), encoding="utf-8") as fh:
        argv = json.load(fh)["argv"]
    statuses = {flag: status for flag, _, status, _ in flag_statuses(argv)}
    assert {"--profile", "--profile-ranks", "--record-memory-history", "--data-path"} <= set(statuses)
    assert [flag for flag, status in statuses.items() if status in ("unknown", "refused")] == []


def test_extract_runs_through_uv_and_nsys(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(
        '#!/bin/bash\nuv run nsys profile --sample=none -o "$1" python -m torch.distributed.run '
        "--nproc_per_node 8 pretrain_gpt.py --num-layers 2 --profile\n"
    )
    assert megatron_flags.extract(str(script), ["prof"], {}) == ["--num-layers", "2", "--profile"]


def test_one_message_names_every_refusal():
    with pytest.raises(ConfigError) as err:
        parse_launch(BASE + ["--optimizer", "muon", "--weight-decay-incr-style", "linear"])
    assert "--optimizer muon: Muon is not built" in str(err.value) and "--weight-decay-incr-style linear:" in str(
        err.value
    )
