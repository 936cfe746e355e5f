"""Property-based fuzz (hypothesis) of everything a user types or points the project at: flags,
YAML files, metadata.json fields, safetensors shard headers, HF config.json files and .bin/.idx
datasets. Every generated input must end in success or in exit 2 with one ``error:`` line --
never a traceback, a hang, a runaway allocation, or a file opened or written outside its case
directory (fuzz_support.py holds the harness). The preflight memory check sees a machine of
``FUZZ_HOST_MEMORY`` so that a size is refused or accepted the same way on any machine.

Seeded (``derandomize``): CI runs the same >= 1,000 cases every time; ``-s`` prints the counts.
"""

import json
import os
import pickle
import shutil
import struct
import time

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import pretrain_m6
from megatron_p2r.arguments import all_fields
from megatron_p2r.checkpoint.metadata import SELF_CHECKSUM
from megatron_p2r.convert.hf.exporter import export_hf
from megatron_p2r.config.ranges import field_kind
from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder
from megatron_p2r.planning import preflight
from tests.convert.megatron.fixtures import (
    MIXTRAL,
    fixture_globals,
    make_weights,
    megatron_args,
    megatron_enums,
    write_torch_dist,
)
from tests.reliability import fuzz_support as fz
from tests.reliability.common import FLAGS
from tools import convert_checkpoint

FUZZ_HOST_MEMORY = 512 * 2**20
BASE = FLAGS + ["--train-iters", "1", "--eval-iters", "1"]
DATA_BASE = [f for f in BASE if f != "--mock-data"] + ["--split", "1,1,0"]
EXAMPLES = {
    "flags": 300,
    "yaml": 200,
    "metadata.json": 180,
    "shard headers": 150,
    "hf config.json": 120,
    ".bin/.idx": 120,
    "megatron args": 80,
    "megatron .metadata": 60,
}


def fuzz(category, shrink=True):
    """``shrink`` False: a failure is reported as found (shrinking cases that each run a converter
    took many minutes)."""
    return settings(
        max_examples=EXAMPLES[category],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        **({} if shrink else {"phases": [Phase.generate]}),
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Templates (a checkpoint, an HF export, a dataset), the RSS bound, the start time."""
    root = tmp_path_factory.mktemp("fuzz")
    ck = root / "templates" / "ck"
    assert pretrain_m6.main(BASE + ["--save", str(ck)]) == 0
    export_hf(str(ck), str(root / "templates" / "hf"), progress=False)
    os.makedirs(root / "templates" / "data")
    b = IndexedDatasetBuilder(str(root / "templates" / "data" / "ds.bin"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        b.add_document(rng.integers(0, 200, rng.integers(5, 40)))
    b.finalize(str(root / "templates" / "data" / "ds.idx"))
    write_torch_dist(
        str(root / "templates" / "megatron" / "src"),
        MIXTRAL,
        make_weights(MIXTRAL, 1),
        megatron_args(MIXTRAL, 1, 1, 1),
        (1, 1, 1),
    )
    patch = pytest.MonkeyPatch()
    patch.setattr(preflight, "available_host_memory", lambda: FUZZ_HOST_MEMORY)
    case_env = {
        "root": str(root),
        "ck": str(ck),
        "hf": str(root / "templates" / "hf"),
        "megatron": str(root / "templates" / "megatron"),
        "data": str(root / "templates" / "data"),
        "rss_bound": fz.start(),
        "start": time.perf_counter(),
    }
    yield case_env
    patch.undo()
    # the counts per category (the figures docs/evidence/reliability.md quotes), whichever tests ran
    print("\n" + fz.report(case_env["rss_bound"], time.perf_counter() - case_env["start"]))


# ----------------------------------------------------------------------------- values

INTS = [
    "0",
    "-1",
    "1",
    "2",
    "3",
    "4",
    "8",
    "16",
    "1000000",
    "2147483648",
    "100000000000000000000000",
    "1.5",
    "x",
    "",
    "nan",
    "0x10",
]
COUNTS = ["-1", "0", "1", "2", "x", "1.5", ""]  # iterations and batch counts: a big one is a long run, not bad input
COUNT_FIELDS = {
    "train_iters",
    "eval_iters",
    "eval_interval",
    "log_interval",
    "save_interval",
    "exit_interval",
    "keep_last",
    "max_skipped_steps",
    "loss_scale_window",
    "global_batch_size",
    "lr_warmup_iters",
    "lr_decay_iters",
    "train_samples",
    "lr_warmup_samples",
    "lr_decay_samples",
    "hysteresis",
    "exit_duration_in_mins",
}
FLOATS = [
    "nan",
    "inf",
    "-inf",
    "0",
    "-0",
    "-1",
    "1e-30",
    "1e-9",
    "0.01",
    "0.5",
    "1",
    "1.5",
    "2",
    "1e30",
    "1e308",
    "x",
    "",
]
PATHS = ["new", "sub/new", "file", "dir", "fifo", "missing/x", "", "file/x", "./dir", "dir/../new"]
PATH_FIELDS = {
    "save",
    "load",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "log_file",
    "tensorboard_dir",
    "data_cache_path",
    "data_path",
    "cpu_offload_optimizer_nvme_path",
}
STRINGS = {
    "share_pattern": ["all", "none", "cycle:2", "block:2", "cycle:0", "block:3", "cycle:x", "x", ""],
    "pipeline_layer_split": ["1,1", "2", "1,0", "a,b", "1,1,1", "", "-1,3"],
    "cpu_offload_layers": ["1", "0.5", "0,1", "auto", "x", "", "-1", "1,1", "2.5"],
    "cpu_offload_what": ["params,grads,optimizer", "optimizer", "grads", "", ","],
    "device_memory_budget": ["1GiB", "x", "0", "1e30", "-1MB"],
    "split": ["969,30,1", "1,0,0", "0,0,0", "a", "-1,2", "1,1,1,1"],
}
# --compile is left out: compiling a layer takes longer than a case's time limit on a small CPU
# (and fills torch's cache outside the case directory); tests/model/test_compiled.py covers it.
FIELDS = [f for _, f in all_fields() if f.name != "compile"]
# The sizes of the model and the batch, drawn as often as all other fields together, from
# values that are either small or absurd (--seq-length 1000000 must be refused, not allocated).
SIZE_FIELDS = [
    f
    for f in FIELDS
    if f.name
    in {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "seq_length",
        "max_position_embeddings",
        "vocab_size",
        "micro_batch_size",
        "num_experts",
        "moe_ffn_hidden_size",
        "make_vocab_size_divisible_by",
        "tensor_model_parallel_size",
        "moe_router_topk",
        "num_query_groups",
        "kv_channels",
        "ddp_bucket_size",
    }
]
SIZES = ["0", "-1", "2", "4", "8", "16", "100000", "1000000", "10000000", "1073741824", "1e30", "x"]


def _case_files(case):
    """What PATHS name: an existing file, an empty directory, a FIFO."""
    with open(os.path.join(case, "file"), "w") as fh:
        fh.write("not what any flag expects\n")
    os.makedirs(os.path.join(case, "dir"))
    os.mkfifo(os.path.join(case, "fifo"))


def _value(data, f, as_text=True):
    """A value for field ``f``: a flag's text, or (``as_text`` False) a YAML scalar."""
    kind = field_kind(f)[0]
    if f.name in PATH_FIELDS:
        return data.draw(st.sampled_from(PATHS))
    if "choices" in f.metadata:
        return data.draw(st.sampled_from(list(f.metadata["choices"]) + ["", "X"]))
    if f.name in STRINGS:
        return data.draw(st.sampled_from(STRINGS[f.name]))
    pool = {"int": SIZES if f in SIZE_FIELDS else COUNTS if f.name in COUNT_FIELDS else INTS, "float": FLOATS}.get(kind)
    if pool is None:
        return data.draw(st.text(max_size=12)) if as_text else data.draw(st.booleans() | st.text(max_size=6))
    text = data.draw(st.sampled_from(pool))
    if as_text:
        return text
    return data.draw(st.sampled_from([text, _scalar(text)]))


def _scalar(text):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


# ----------------------------------------------------------------------------- flags and YAML


@fuzz("flags")
@given(data=st.data())
def test_fuzz_flags(env, data):
    case = fz.fresh_dir(env["root"], "flags")
    _case_files(case)
    argv = list(BASE)
    for f in data.draw(st.lists(st.sampled_from(FIELDS) | st.sampled_from(SIZE_FIELDS), min_size=1, max_size=3)):
        flag = "--" + f.name.replace("_", "-")
        if field_kind(f)[0] == "bool":
            argv.append(flag)
        elif "nargs" in f.metadata:
            argv += [flag] + data.draw(st.lists(st.sampled_from(PATHS + ["0.5", "-1", "x"]), min_size=1, max_size=4))
        else:
            argv += [flag, _value(data, f)]
    fz.run_case("flags", case, pretrain_m6.main, argv, env["rss_bound"])


def _yaml_text(data):
    """A YAML document of real flag names (and some unknown keys), then maybe mangled."""
    doc = {}
    for f in data.draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        key = data.draw(st.sampled_from([f.name, f.name.replace("_", "-"), "--" + f.name.replace("_", "-")]))
        doc[key] = _value(data, f, as_text=False)
    junk = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=2),
        max_leaves=5,
    )
    doc.update(data.draw(st.dictionaries(st.sampled_from(["hidden-size", "x", "num-layers", "lr"]), junk, max_size=1)))
    text = yaml.safe_dump(doc, allow_unicode=True)
    mangle = data.draw(st.sampled_from(["none", "alias", "duplicate", "deep", "bytes", "tab", "list", "truncate"]))
    if mangle == "alias":
        text = "base: &b {num-layers: 2}\nhidden-size: &h 32\nlr: *h\n" + text
    elif mangle == "duplicate" and text.strip() not in ("{}", ""):
        text += text.splitlines()[0] + "\n"
    elif mangle == "deep":
        text += "lr: " + "[" * 200 + "]" * 200 + "\n"
    elif mangle == "bytes":
        return text.encode() + data.draw(st.binary(max_size=20))
    elif mangle == "tab":
        text = "\t" + text
    elif mangle == "list":
        text = "- " + text.replace("\n", "\n  ")
    elif mangle == "truncate":
        text = text[: data.draw(st.integers(0, len(text)))]
    return text.encode()


@fuzz("yaml")
@given(data=st.data())
def test_fuzz_yaml(env, data):
    case = fz.fresh_dir(env["root"], "yaml")
    _case_files(case)
    with open(os.path.join(case, "config.yaml"), "wb") as fh:
        fh.write(_yaml_text(data))
    fz.run_case("yaml", case, pretrain_m6.main, ["--config", "config.yaml"] + BASE, env["rss_bound"])


# ----------------------------------------------------------------------------- JSON files

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, -1, 1, 2, 7, 2**31, 2**63, 10**30, -(10**9)])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "../../x.safetensors",
            "/etc/passwd",
            "mp_rank_00_000_000.safetensors",
            "F32",
            "pseudo",
            "real",
            "gpt2",
            "llama",
            "mixtral",
            "rope",
            "../../../outside",
        ]
    )
)
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)


def _paths(doc, prefix=()):
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield from _paths(value, prefix + (key,))


def _mutate_json(data, doc):
    """1-3 edits at random places of a JSON document: replace a value, delete or add a key."""
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(_paths(doc))))
        if not path:
            if data.draw(st.booleans()):
                return data.draw(JSON_VALUES)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "insert"]))
        if action == "replace":
            parent[path[-1]] = data.draw(JSON_VALUES)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(JSON_VALUES)
    return doc


def _json_text(data, doc) -> bytes:
    """``doc`` as JSON text, maybe with text-level damage JSON values cannot express."""
    text = json.dumps(doc)
    damage = data.draw(st.sampled_from(["none"] * 6 + ["nan", "duplicate", "truncate", "deep", "latin-1"]))
    if damage == "nan":
        text = text.replace("0", "NaN", 1)
    elif damage == "duplicate" and text.startswith("{") and len(text) > 2:
        text = text[:-1] + ", " + text[1:]
    elif damage == "truncate":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif damage == "deep":
        text = "[" * 5000 + "]" * 5000
    elif damage == "latin-1":
        return text.encode() + b"\xff\xfe"
    return text.encode()


@fuzz("metadata.json")
@given(data=st.data())
def test_fuzz_metadata_json(env, data):
    case = fz.fresh_dir(env["root"], "metadata.json", env["ck"])
    meta_path = os.path.join(case, "iter_0000001", "metadata.json")
    with open(meta_path, encoding="utf-8") as fh:
        doc = json.load(fh)
    if data.draw(st.booleans()):  # as written before metadata_crc32: the edits reach the schema's checks
        doc.pop(SELF_CHECKSUM)
    with open(meta_path, "wb") as fh:
        fh.write(_json_text(data, _mutate_json(data, doc)))
    if data.draw(st.booleans()):
        entry, argv = convert_checkpoint.main, ["inspect", "."]
    else:
        entry, argv = pretrain_m6.main, FLAGS + ["--train-iters", "2", "--load", "."]
    fz.run_case("metadata.json", case, entry, argv, env["rss_bound"])


def _mutate_header(data, raw: bytes) -> bytes:
    """A shard with its header edited (entries, dtypes, shapes, offsets, metadata) or its bytes damaged."""
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    kind = data.draw(st.sampled_from(["entry", "entry", "duplicate", "length", "bytes", "truncate", "extend"]))
    if kind == "entry":
        entry = header[data.draw(st.sampled_from(names))]
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[field] = data.draw(
            st.sampled_from(
                [["F16"], "BF16", "F8_E4M3", "I64", [0, 0], [2**40], [0, 2**62], [-4, 4], [1, 2, 3], "x", None]
            )
            | JSON_VALUES
        )
    elif kind == "duplicate":
        a, b = data.draw(st.sampled_from(names)), data.draw(st.sampled_from(names))
        header[a] = dict(header[b])
    if kind in ("entry", "duplicate"):
        blob = _json_text(data, header)
        return struct.pack("<Q", len(blob)) + blob + body
    if kind == "length":
        return struct.pack("<Q", data.draw(st.sampled_from([0, 1, n - 1, n + 8, 2**30, 2**63]))) + raw[8:]
    if kind == "bytes":
        i = data.draw(st.integers(0, 8 + n - 1))
        return raw[:i] + data.draw(st.binary(min_size=1, max_size=4)) + raw[i + 1 :]
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    return raw + data.draw(st.binary(min_size=1, max_size=64))


@fuzz("shard headers")
@given(data=st.data())
def test_fuzz_shard_headers(env, data):
    case = fz.fresh_dir(env["root"], "shard headers", env["ck"])
    rel = data.draw(
        st.sampled_from(
            ["iter_0000001/mp_rank_00_000_000.safetensors", "iter_0000001/rng_and_data/rank_00000.safetensors"]
        )
    )
    path = os.path.join(case, rel)
    with open(path, "rb") as fh:
        raw = fh.read()
    with open(path, "wb") as fh:
        fh.write(_mutate_header(data, raw))
    if data.draw(st.booleans()):
        entry, argv = convert_checkpoint.main, ["inspect", "."]
    else:
        entry, argv = pretrain_m6.main, FLAGS + ["--train-iters", "2", "--load", "."]
    fz.run_case("shard headers", case, entry, argv, env["rss_bound"])


@fuzz("hf config.json")
@given(data=st.data())
def test_fuzz_hf_config(env, data):
    case = fz.fresh_dir(env["root"], "hf config.json")
    shutil.copytree(env["hf"], os.path.join(case, "hf"))
    path = os.path.join(case, "hf", "config.json")
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    doc["model_type"] = data.draw(st.sampled_from(["gpt2"] * 3 + ["llama", "mixtral", "mistral", "qwen2"]))
    with open(path, "wb") as fh:
        fh.write(_json_text(data, _mutate_json(data, doc)))
    argv = ["import-hf", "hf", "out", "--no-progress"] + data.draw(
        st.sampled_from(
            [
                [],
                [],
                [],
                ["--target-tensor-parallel-size", "2"],
                ["--make-vocab-size-divisible-by", "0"],
                ["--make-vocab-size-divisible-by", "1000000000"],
                ["--target-pipeline-parallel-size", "1000000000"],
            ]
        )
    )
    fz.run_case("hf config.json", case, convert_checkpoint.main, argv, env["rss_bound"])


# ----------------------------------------------------------------------------- datasets


def _mutate_dataset(data, idx: bytes, binary: bytes):
    """(.idx, .bin) with a header field, an index entry or a file length changed."""
    n_seq = struct.unpack("<Q", idx[18:26])[0]
    fields = {
        "magic": (0, "9s"),
        "version": (9, "<Q"),
        "dtype": (17, "<B"),
        "sequences": (18, "<Q"),
        "documents": (26, "<Q"),
        "length": (34 + 4 * data.draw(st.integers(0, n_seq - 1)), "<i"),
        "pointer": (34 + 4 * n_seq + 8 * data.draw(st.integers(0, n_seq - 1)), "<q"),
    }
    kind = data.draw(st.sampled_from(sorted(fields) + ["truncate idx", "truncate bin", "extend bin", "token"]))
    if kind in fields:
        offset, fmt = fields[kind]
        value = (
            data.draw(st.binary(min_size=9, max_size=9))
            if fmt == "9s"
            else data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255, 2**31 - 1, -1, -(2**31)]))
            if fmt in ("<B", "<i")
            else data.draw(st.sampled_from([0, 1, 2, 2**32, 2**62, -1, -(2**63)]))
        )
        if fmt == "<B":
            value %= 256
        elif fmt == "<Q":
            value %= 2**64
        return idx[:offset] + struct.pack(fmt, value) + idx[offset + struct.calcsize(fmt) :], binary
    if kind == "truncate idx":
        return idx[: data.draw(st.integers(0, len(idx) - 1))], binary
    if kind == "truncate bin":
        return idx, binary[: data.draw(st.integers(0, len(binary) - 1))]
    if kind == "extend bin":
        return idx, binary + data.draw(st.binary(min_size=1, max_size=8))
    i = 2 * data.draw(st.integers(0, len(binary) // 2 - 1))  # a token id anywhere in 0..65535
    return idx, binary[:i] + struct.pack("<H", data.draw(st.integers(0, 2**16 - 1))) + binary[i + 2 :]


@fuzz(".bin/.idx")
@given(data=st.data())
def test_fuzz_indexed_dataset(env, data):
    case = fz.fresh_dir(env["root"], ".bin/.idx", env["data"])
    idx_path, bin_path = os.path.join(case, "ds.idx"), os.path.join(case, "ds.bin")
    with open(idx_path, "rb") as fi, open(bin_path, "rb") as fb:
        idx, binary = _mutate_dataset(data, fi.read(), fb.read())
    with open(idx_path, "wb") as fi, open(bin_path, "wb") as fb:
        fi.write(idx)
        fb.write(binary)
    fz.run_case(".bin/.idx", case, pretrain_m6.main, DATA_BASE + ["--data-path", "ds"], env["rss_bound"])


# ----------------------------------------------------------------------------- import-megatron


def _shared_nest(depth=60):
    x = [1]
    for _ in range(depth):
        x = [x, x]
    return x


# Wrongly typed, absurd and nested values for the args import-megatron reads (issue 38: tracebacks
# on "two", lists, 0 heads, a memory blow-up on a huge padded_vocab_size).
ARG_VALUES = st.sampled_from(
    [
        0,
        -1,
        1,
        2,
        3,
        4,
        7,
        2**31,
        10**12,
        10**30,
        True,
        False,
        None,
        0.5,
        float("nan"),
        float("inf"),
        "two",
        "4",
        "",
        "RMSNorm",
        "rope",
        "aux_loss",
        [2],
        [],
        [[1]],
        [1, 0, 1, 1],
        (4, 0),
        [3, 0],
        {"a": 1},
        b"x",
    ]
) | st.builds(_shared_nest)
ARG_NAMES = sorted(vars(megatron_args(MIXTRAL, 1, 1, 1))) + [
    "window_size",
    "window_attn_skip_freq",
    "num_moe_experts",
    "kv_channels",
    "softmax_type",
    "mtp_num_layers",
]


def _edit_common(path, change):
    """Rewrite common.pt (the test's own trusted file) after ``change(state)``."""
    with megatron_enums() as backend, torch.serialization.safe_globals(fixture_globals(backend)):
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)


@fuzz("megatron args", shrink=False)
@given(data=st.data())
def test_fuzz_megatron_args(env, data):
    case = fz.fresh_dir(env["root"], "megatron args", env["megatron"])
    edits = data.draw(st.dictionaries(st.sampled_from(ARG_NAMES), ARG_VALUES, min_size=1, max_size=3))
    _edit_common(
        os.path.join(case, "src", "iter_0000007", "common.pt"), lambda state: vars(state["args"]).update(edits)
    )
    fz.run_case(
        "megatron args",
        case,
        convert_checkpoint.main,
        ["import-megatron", "src", "out", "--no-progress"],
        env["rss_bound"],
    )


METADATA_VALUES = ARG_VALUES | st.sampled_from(
    ["abc", "../x", "/etc/passwd", "__0_0.distcp", [0, 0], [0, 2**62], (0,) * 9, [-1], ["x"]]
)


def _mutate_dcp_metadata(data, metadata) -> None:
    """1-2 edits of a field of .metadata: a storage record's, an index's, an entry's, or a top one."""
    records, entries = list(metadata.storage_data.items()), list(metadata.state_dict_metadata.values())
    for _ in range(data.draw(st.integers(1, 2))):
        where = data.draw(st.sampled_from(["storage", "index", "entry", "chunk", "top"]))
        index, info = data.draw(st.sampled_from(records))
        entry = data.draw(st.sampled_from(entries))
        target, fields = {
            "storage": (info, ["offset", "length", "relative_path"]),
            "index": (index, ["fqn", "offset", "index"]),
            "entry": (entry, ["size", "chunks", "properties"]),
            "chunk": (
                getattr(entry, "chunks", [entry])[0] if getattr(entry, "chunks", None) else entry,
                ["offsets", "sizes"],
            ),
            "top": (metadata, ["state_dict_metadata", "storage_data", "planner_data"]),
        }[where]
        name, value = data.draw(st.sampled_from(fields)), data.draw(METADATA_VALUES)
        try:
            object.__setattr__(target, name, value)  # frozen dataclasses too: the test writes the pickle itself
        except (AttributeError, TypeError):
            pass


@fuzz("megatron .metadata", shrink=False)
@given(data=st.data())
def test_fuzz_megatron_dcp_metadata(env, data):
    case = fz.fresh_dir(env["root"], "megatron .metadata", env["megatron"])
    path = os.path.join(case, "src", "iter_0000007", ".metadata")
    with open(path, "rb") as fh:
        metadata = pickle.load(fh)  # the test's own trusted file
    _mutate_dcp_metadata(data, metadata)
    with open(path, "wb") as fh:
        pickle.dump(metadata, fh)
    fz.run_case(
        "megatron .metadata",
        case,
        convert_checkpoint.main,
        ["import-megatron", "src", "out", "--no-progress"],
        env["rss_bound"],
    )


def test_the_fuzzer_asks_for_at_least_1000_cases():
    """Each category's test generates its EXAMPLES (hypothesis stops early only when a strategy
    runs out of cases); together at least 1,000."""
    assert sum(EXAMPLES.values()) >= 1000
