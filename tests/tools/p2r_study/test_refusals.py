"""What the study refuses, each with one ``error:`` line and no traceback (issue 38, bugs 2 and 4,
a single-line jsonl too long to read whole, and the shipped reports in docs/)."""

import json
import os

import numpy as np

from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder
from tools.p2r_study import cli, corpus, identity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# the issue's command, less --data-path and --work
ISSUE = [
    "--tokenizer-type",
    "ByteTokenizer",
    "--report-only",
    "--timing-rounds",
    "0",
    "--seq",
    "32",
    "--eval-samples",
    "4",
]


def _docs(path, count, words=30):
    with open(path, "w") as fh:
        for d in range(count):
            fh.write(json.dumps({"text": " ".join(f"w{(d * 13 + i) % 97}" for i in range(words))}) + "\n")
    return str(path)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_work_built_from_other_data_is_refused(tmp_path, capsys, monkeypatch):
    """Bug 2: c1 (300 documents) then c2 (40) on one --work: refused, naming both paths; the same
    path with other content is refused too, and the runs' keys carry the data's hash."""
    monkeypatch.chdir(tmp_path)
    c1, c2 = _docs(tmp_path / "c1.jsonl", 300), _docs(tmp_path / "c2.jsonl", 40)
    assert cli.main([*ISSUE, "--data-path", "c1.jsonl", "--work", "sw"]) == 2
    assert "no finished run" in _error(capsys)
    assert json.load(open(tmp_path / "sw" / "study.json"))["data"]["path"] == c1
    assert cli.main([*ISSUE, "--data-path", "c2.jsonl", "--work", "sw"]) == 2
    err = _error(capsys)
    assert f"--work {tmp_path / 'sw'} was built from {c1} (sha256 " in err and f"not from --data-path {c2}" in err
    _docs(tmp_path / "c1.jsonl", 301)
    assert cli.main([*ISSUE, "--data-path", "c1.jsonl", "--work", "sw"]) == 2
    assert f"was built from --data-path {c1}, whose content has changed since" in _error(capsys)
    assert not os.path.exists(tmp_path / "sw" / "corpus")  # nothing of c2 was prepared
    args = cli.build_parser().parse_args([*ISSUE, "--data-path", c1, "--work", "x"])
    keys = {identity.identity_key(identity.study_identity(args))}
    args.data_path = c2
    keys.add(identity.identity_key(identity.study_identity(args)))
    assert len(keys) == 2


def test_a_work_of_an_older_study_is_refused(tmp_path, capsys):
    (tmp_path / "study.json").write_text(json.dumps({"data": "/old/train_text_document", "lr": 0.002}))
    assert cli.main([*ISSUE, "--work", str(tmp_path)]) == 2
    assert "written by an older version of the study" in _error(capsys)


def test_a_work_or_out_naming_a_file(tmp_path, capsys):
    """Bug 4: NotADirectoryError before."""
    (tmp_path / "f").write_text("x")
    assert cli.main([*ISSUE, "--work", str(tmp_path / "f")]) == 2
    assert f"--work {tmp_path / 'f'} is a file; expected a directory" in _error(capsys)
    assert cli.main([*ISSUE, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "f")]) == 2
    assert "--out" in _error(capsys) and not os.path.exists(tmp_path / "w")


def test_a_truncated_index_names_the_file(tmp_path, capsys):
    """Bug 4: a prefix whose .idx is cut to 100 bytes (the reader's ValueError escaped before)."""
    prefix = str(tmp_path / "p")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(50):
        builder.add_document(np.arange(d, d + 40) % 250)
    builder.finalize(prefix + ".idx")
    with open(prefix + ".idx", "r+b") as fh:
        fh.truncate(100)
    assert (
        cli.main(
            [
                "--tokenizer-type",
                "ByteTokenizer",
                "--data-path",
                prefix,
                "--work",
                str(tmp_path / "w"),
                "--timing-rounds",
                "0",
            ]
        )
        == 2
    )
    assert f"{prefix}.idx: not a valid Megatron indexed dataset: 100 bytes, expected" in _error(capsys)


def test_report_only_before_any_run(tmp_path, capsys):
    """Bug 4: matplotlib's "Number of rows must be a positive integer, not 0" before."""
    assert cli.main([*ISSUE, "--data-path", _docs(tmp_path / "c.jsonl", 300), "--work", str(tmp_path / "w")]) == 2
    assert "--report-only: no finished run in --work" in _error(capsys)


def test_the_shipped_reports_are_never_replaced(tmp_path, capsys):
    """Bug 3's default wrote into docs/: now only a report this --work wrote is replaced."""
    shipped = os.path.join(ROOT, "docs", "p2r_convergence.png")
    before = open(shipped, "rb").read()
    for name in ("p2r_convergence", "p2r_study"):  # the shipped figure; this tool's guide, docs/p2r_study.md
        assert (
            cli.main([*ISSUE, "--work", str(tmp_path / name), "--out", os.path.join(ROOT, "docs"), "--name", name]) == 2
        )
        assert "was not written by the study in --work" in _error(capsys)
    assert open(shipped, "rb").read() == before


def test_a_line_too_long_to_read_whole(tmp_path, capsys, monkeypatch):
    """A 200 MB single-line jsonl (here the limit is lowered to 1000 bytes, the line 5000): refused
    before any tool reads it, naming the file; the scan reads fixed chunks (here 64 bytes)."""
    monkeypatch.setattr(identity, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(identity, "CHUNK_BYTES", 64)
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "short"}\n' + json.dumps({"text": "x" * 5000}) + "\n")
    assert cli.main(["--tokenizer-type", "ByteTokenizer", "--data-path", str(data), "--work", str(tmp_path / "w")]) == 2
    assert f"--data-path {data}: line 2 holds 5,012 bytes" in _error(capsys)
    assert not os.path.exists(tmp_path / "w")
    lines = [b"a" * 10, b"", b"b" * 130, b"c" * 63, b"d" * 64, b"e" * 3]
    (tmp_path / "l.jsonl").write_bytes(b"\n".join(lines))  # no final newline: the last line counts too
    assert identity._longest_line(str(tmp_path / "l.jsonl")) == (130, 3)
    (tmp_path / "l.jsonl").write_bytes(b"\n".join(lines + [b"f" * 200]))
    assert identity._longest_line(str(tmp_path / "l.jsonl")) == (200, 7)


def test_seeded_held_out_documents(tmp_path):
    """The default held-out set: a seeded sample of whole documents, not the tail, none trained on."""
    prefix = str(tmp_path / "p")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(40):
        builder.add_document(np.full(d % 7 + 1, d))
    builder.finalize(prefix + ".idx")
    chosen = corpus.held_out_documents(40, 4, seed=1234)
    assert list(chosen) == list(corpus.held_out_documents(40, 4, seed=1234)) and list(chosen) != [36, 37, 38, 39]
    kept, held = corpus.seeded_split(prefix, 4, 1234, str(tmp_path / "split"))
    train, valid = corpus.open_indexed(kept), corpus.open_indexed(held)
    assert [int(valid[i][0]) for i in range(len(valid))] == list(chosen)
    assert [int(train[i][0]) for i in range(len(train))] == [d for d in range(40) if d not in chosen]
