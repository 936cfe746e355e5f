"""Bounded, seeded fuzzing of everything a user types or points at: flags and YAML, checkpoints,
indexed datasets, jsonl corpora. Every case must end in a clear error (one message naming the
flag/file/field, exit code 1 or 2) or, for skippable bad lines, a correct output; never a
traceback from deep inside, a hang, or a partially written output."""

import contextlib
import gzip
import io
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import pytest

from megatron_p2r.arguments import parse_args
from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.checkpoint.io import load_checkpoint
from megatron_p2r.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.training import build_train_state
from tests.reliability.common import FLAGS, tree_digest
from tools import preprocess_data

import pretrain_m6

TALLY = {}  # kind -> cases tried


@pytest.fixture(scope="module", autouse=True)
def print_tally():
    """With -s, how many bad inputs the module tried, printed after its last test whichever
    tests ran and in whatever order."""
    yield
    print("\nbad inputs tried:", ", ".join(f"{k}: {v}" for k, v in TALLY.items()), f"(total {sum(TALLY.values())})")


def _count(kind, n=1):
    TALLY[kind] = TALLY.get(kind, 0) + n


def _main(argv):
    """(exit code, stderr) of pretrain_m6.main in this process; argparse errors exit 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = pretrain_m6.main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return rc, err.getvalue()


BASE = FLAGS + ["--train-iters", "1"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A checkpoint of the BASE model (iteration 1), bad tokenizer files, YAML files, a dataset."""
    root = tmp_path_factory.mktemp("bad_input")
    rc, err = _main(BASE + ["--save", root / "ck"])
    assert rc == 0, err
    (root / "garbage.model").write_bytes(b"\x00not a sentencepiece model")
    (root / "vocab.json").write_text("[1, 2")
    (root / "merges.txt").write_text("#version: 0.2\na b c\n")
    (root / "unknown.yaml").write_text("hiden-size: 64\n")
    (root / "wrongtype.yaml").write_text("num-layers: two\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "broken.yaml").write_text("a: [1\n")
    b = IndexedDatasetBuilder(str(root / "ds.bin"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(30):
        b.add_document(rng.integers(0, 200, rng.integers(1, 40)))
    b.finalize(str(root / "ds.idx"))
    return root


def _mutations(w):
    """(flags, expected message fragment) -- each wrong on its own."""
    return [
        (["--num-attention-heads", "5"], "must be divisible by --num-attention-heads (5)"),
        (["--num-layers", "0"], "--num-layers must be >= 1"),
        (["--hidden-size", "abc"], "invalid int value: 'abc'"),
        (["--normalization", "BatchNorm"], "invalid choice: 'BatchNorm'"),
        (["--num-layrs", "2"], "unrecognized arguments: --num-layrs"),
        (["--tensor-model-parallel-size", "2"], "world size 1 must be divisible"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
        (["--log-interval", "0"], "--log-interval must be >= 1"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout must be < 1, got 1.5"),
        (["--keep-last", "-1"], "--keep-last must be >= 1"),
        (["--global-batch-size", "3"], "--global-batch-size (3) must be divisible"),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be >= 0.01"),
        (["--seq-length", "64", "--max-position-embeddings", "32"], "--max-position-embeddings (32) must be >="),
        (["--p2r-phase", "pseudo", "--share-pattern", "cycle:x"], "--share-pattern 'cycle:x'"),
        (["--pipeline-layer-split", "a,b"], "--pipeline-layer-split 'a,b'"),
        (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk (5) must be between"),
        (["--num-experts", "4", "--moe-capacity-factor", "-1"], "--moe-capacity-factor must be > 0"),
        (["--cpu-offload-layers", "banana"], "--cpu-offload-layers 'banana'"),
        (["--data-path", w / "missing"], "--mock-data and --data-path are mutually exclusive"),
        (
            ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", w / "garbage.model"],
            "not a SentencePiece model",
        ),
        (
            [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                w / "vocab.json",
                "--merge-file",
                w / "merges.txt",
            ],
            "cannot read a JSON vocabulary",
        ),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", w / "nope.model"], "no such file"),
        (["--config", w / "unknown.yaml"], "unknown key 'hiden-size'; did you mean 'hidden-size'?"),
        (["--config", w / "wrongtype.yaml"], "key 'num-layers' expects int, got 'two'"),
        (["--config", w / "list.yaml"], "expected a mapping of flag names to values"),
        (["--config", w / "broken.yaml"], "not valid YAML"),
        (["--config", w / "nope.yaml"], "--config: no such file"),
        (["--load", w / "nope"], "no checkpoint at"),
        (["--load", w / "ck", "--hidden-size", "64"], "hidden_size = 32, this run has 64 (--hidden-size)"),
        (["--load", w / "ck", "--num-layers", "3"], "num_layers = 2, this run has 3 (--num-layers)"),
        (["--load", w / "ck", "--p2r-phase", "pseudo"], "a real checkpoint cannot be loaded into a pseudo-phase"),
    ]


def _assert_clear(rc, err, case):
    assert rc in (1, 2), (case, rc, err)
    assert "Traceback" not in err, (case, err)
    assert "error: " in err or "error:" in err, (case, err)


def test_bad_flags_each_give_their_message_and_write_nothing(workspace):
    before = tree_digest(str(workspace / "ck"))
    log = workspace / "log.jsonl"
    for flags, fragment in _mutations(workspace):
        rc, err = _main(BASE + ["--save", workspace / "ck", "--log-file", log] + flags)
        _assert_clear(rc, err, flags)
        assert fragment in err, (flags, fragment, err)
        _count("flags and YAML (one fault each)")
    assert tree_digest(str(workspace / "ck")) == before and not log.exists()


def test_random_bad_flag_combinations(workspace):
    """24 seeded combinations of 2-3 mutations: still one clear error, nothing written."""
    before = tree_digest(str(workspace / "ck"))
    pool = _mutations(workspace)
    rng = random.Random(12)
    for case in range(24):
        picks = rng.sample(pool, rng.randint(2, 3))
        flags = [f for p, _ in picks for f in p]
        rc, err = _main(BASE + ["--save", workspace / "ck"] + flags)
        _assert_clear(rc, err, flags)
        assert len([line for line in err.splitlines() if "error:" in line]) == 1, (flags, err)
        _count("flag combinations")
    assert tree_digest(str(workspace / "ck")) == before


# ----------------------------------------------------------------------------- checkpoints


def _corruptions(rng):
    """Seeded corruption functions of a checkpoint directory: headers and metadata (a flipped bit in
    a tensor data region fails its checksum: tests/checkpoint/test_checksums.py)."""
    it = "iter_0000001"
    shard, rngf, meta = (
        f"{it}/mp_rank_00_000_000.safetensors",
        f"{it}/rng_and_data/rank_00000.safetensors",
        f"{it}/metadata.json",
    )

    def truncate(rel):
        def go(d):
            data = (d / rel).read_bytes()
            (d / rel).write_bytes(data[: rng.randrange(len(data))])

        return go

    def flip_header(rel):
        def go(d):
            data = bytearray((d / rel).read_bytes())
            n = int.from_bytes(data[:8], "little")
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(8 + n)] = rng.randrange(256)
            (d / rel).write_bytes(bytes(data))

        return go

    def edit_meta(d):
        m = json.loads((d / meta).read_text())
        field = rng.choice(
            [
                "iteration",
                "consumed_samples",
                "config",
                "layout",
                "p2r",
                "optimizer",
                "tensors",
                "files",
                "scheduler",
                "scaler",
                "rng",
                "format_version",
            ]
        )
        junk = rng.choice([None, "x", -3, 1.5, [], {}, {"a": 1}, True])
        if field == "rng" and junk is None:
            junk = "x"
        m[field] = junk
        (d / meta).write_text(json.dumps(m))

    def edit_model(d):
        m = json.loads((d / meta).read_text())
        key = rng.choice(["num_layers", "hidden_size", "num_attention_heads", "vocab_size", "swiglu"])
        m["config"]["model"][key] = {
            "num_layers": 5,
            "hidden_size": 48,
            "num_attention_heads": 8,
            "vocab_size": 999,
            "swiglu": True,
        }[key]
        (d / meta).write_text(json.dumps(m))

    def pickled(rel):
        return lambda d: (d / rel).write_bytes(pickle.dumps({"weights": list(range(10))}))

    def latest_junk(d):
        (d / "latest_checkpointed_iteration.txt").write_bytes(rng.choice([b"", b"abc", b"\xff\xfe", b"-4", b"7"]))

    return [
        truncate(shard),
        truncate(rngf),
        truncate(meta),
        flip_header(shard),
        flip_header(rngf),
        edit_meta,
        edit_model,
        pickled(shard),
        latest_junk,
        lambda d: (d / shard).unlink(),
    ]


def test_corrupted_checkpoints_fail_with_checkpoint_error(workspace, tmp_path):
    rng = random.Random(3)
    kinds = _corruptions(rng)
    state = build_train_state(parse_args(BASE), ParallelState.single())
    for case in range(40):
        d = tmp_path / f"case{case}"
        shutil.copytree(workspace / "ck", d)
        corrupt = kinds[case % len(kinds)]
        corrupt(d)
        before = tree_digest(str(d))
        with pytest.raises(CheckpointError) as exc:
            load_checkpoint(str(d), state)
        assert str(d) in str(exc.value) or "metadata.json" in str(exc.value), str(exc.value)
        assert tree_digest(str(d)) == before
        shutil.rmtree(d)
        _count("corrupted checkpoints")
    # Through the CLI: exit code 2 and one line, for two of them.
    for case, corrupt in enumerate(kinds[:2]):
        d = tmp_path / f"cli{case}"
        shutil.copytree(workspace / "ck", d)
        corrupt(d)
        rc, err = _main(BASE + ["--load", d])
        assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
        _count("corrupted checkpoints")


# ----------------------------------------------------------------------------- datasets


def test_truncated_or_corrupted_indexed_datasets(workspace, tmp_path):
    idx, binary = (workspace / "ds.idx").read_bytes(), (workspace / "ds.bin").read_bytes()
    n_seq = 30
    end_of_pointers = 34 + n_seq * 12  # header, lengths, pointers (document indices excluded: see docs)
    rng = random.Random(5)
    for case in range(30):
        i, b = bytearray(idx), bytearray(binary)
        kind = case % 3
        if kind == 0:
            i = i[: rng.randrange(len(i))]
        elif kind == 1:
            b = b[: rng.randrange(len(b))]
        else:
            pos = rng.randrange(end_of_pointers)
            i[pos] ^= 1 << rng.randrange(8)
        (tmp_path / "c.idx").write_bytes(bytes(i))
        (tmp_path / "c.bin").write_bytes(bytes(b))
        with pytest.raises(ValueError) as exc:
            IndexedDataset(str(tmp_path / "c"))
        assert str(tmp_path / "c.") in str(exc.value)
        _count("truncated/corrupted .bin/.idx")
    rc, err = _main([f for f in BASE if f != "--mock-data"] + ["--data-path", tmp_path / "c", "--split", "1,0,0"])
    assert rc == 2 and "error: --data-path" in err and "Traceback" not in err, err
    _count("truncated/corrupted .bin/.idx")


def _bad_line(rng):
    return rng.choice(
        [
            lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))),
            lambda: json.dumps(
                rng.choice([[1, 2], "str", 3, None, {"text": 5}, {"other": "x"}, {"text": ["a"]}])
            ).encode(),
            lambda: b"[" * 50000 + b"]" * 50000,
            lambda: b'{"text": "bad \\ud800 surrogate"}',
            lambda: b'{"text": "unterminated',
            lambda: '{"text": "caf\u00e9"}'.encode("latin-1"),
        ]
    )()


def test_malformed_jsonl_is_reported_and_never_half_written(tmp_path):
    rng = random.Random(9)
    for case in range(12):
        lines, good = [], 0
        for _ in range(rng.randint(5, 25)):
            if rng.random() < 0.5:
                lines.append(json.dumps({"text": f"doc {good} ok"}).encode())
                good += 1
            else:
                lines.append(_bad_line(rng))
        path = tmp_path / f"in{case}.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
        out = tmp_path / f"out{case}"
        argv = ["--input", str(path), "--output-prefix", str(out / "c"), "--tokenizer-type", "ByteTokenizer"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert preprocess_data.main(argv) == (0 if good else 2)  # no document at all: an error
        if not good:
            assert "error: --input" in err.getvalue() and not os.listdir(out)
            continue
        ds = IndexedDataset(str(out / "c_text_document"))
        assert len(ds) == good and sorted(os.listdir(out)) == ["c_text_document.bin", "c_text_document.idx"]
        assert len(lines) == good or "bad line(s)" in err.getvalue()
        if len(lines) > good:  # --strict stops at the first bad line, leaving no output
            strict = tmp_path / f"strict{case}"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                assert (
                    preprocess_data.main(
                        argv[:2]
                        + ["--output-prefix", str(strict / "c"), "--tokenizer-type", "ByteTokenizer", "--strict"]
                    )
                    == 2
                )
            assert re.search(rf"error: {path}:\d+: ", err.getvalue())
            assert not os.listdir(strict)
        _count("malformed jsonl files")
    whole = gzip.compress(b'{"text": "hello"}\n' * 500)
    for name, data in [("trunc.jsonl.gz", whole[: len(whole) // 2]), ("fake.jsonl.gz", b"not gzip")]:
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out_{name}"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert (
                preprocess_data.main(
                    [
                        "--input",
                        str(tmp_path / name),
                        "--output-prefix",
                        str(out / "c"),
                        "--tokenizer-type",
                        "ByteTokenizer",
                    ]
                )
                == 2
            )
        assert "cannot decompress it" in err.getvalue()
        assert not out.exists() or not os.listdir(out)  # no output, no temporary files
        _count("malformed jsonl files")
