import pytest
import json
import sysconfig

from tests.helpers import bad_input_error
from tools import build_demo_corpus


def read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_deterministic_sorted_stdlib_documents(tmp_path):
    assert build_demo_corpus.main(["--output", str(tmp_path / "a.jsonl"), "--max-docs", "12"]) == 0
    assert build_demo_corpus.main(["--output", str(tmp_path / "b.jsonl"), "--max-docs", "12"]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    docs = read(tmp_path / "a.jsonl")
    assert len(docs) == 12
    paths = [d["path"] for d in docs]
    assert paths == sorted(paths) and all(p.endswith(".py") and "site-packages" not in p for p in paths)
    root = sysconfig.get_paths()["stdlib"]
    with open(f"{root}/{paths[3]}", encoding="utf-8") as f:
        assert docs[3]["text"] == f.read()


def test_max_bytes_and_no_overwrite(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    build_demo_corpus.main(["--output", str(out), "--max-bytes", "100000"])
    docs = read(out)
    total = sum(len(d["text"].encode("utf-8")) for d in docs)
    assert 0 < total <= 100000 and len(docs) > 1
    assert "already exists" in bad_input_error(build_demo_corpus.main, ["--output", out, "--max-docs", "1"], capsys)
    assert read(out) == docs


@pytest.mark.slow
def test_docs_source_is_english_text_not_code(tmp_path):
    """--source docs: the reference topics, then per module its longer docstrings, without the code."""
    out = tmp_path / "d.jsonl"
    assert build_demo_corpus.main(["--output", str(out), "--source", "docs", "--max-bytes", "3000000"]) == 0
    docs = read(out)
    from pydoc_data.topics import topics

    assert [d["path"] for d in docs[: len(topics)]] == [f"pydoc_data/topics/{n}" for n in sorted(topics)]
    assert docs[0]["text"] == topics[sorted(topics)[0]]
    modules = docs[len(topics) :]
    paths = [d["path"] for d in modules]
    assert paths == sorted(paths) and not any("/test/" in p or p.startswith("test/") for p in paths)
    json_doc = next(d["text"] for d in modules if d["path"] == "json/__init__.py")
    assert json_doc.startswith("JSON (JavaScript Object Notation)") and "\ndef " not in json_doc
