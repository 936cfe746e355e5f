import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_p2r.data.indexed_dataset import IndexedDataset
from megatron_p2r.data.tokenizers import ByteTokenizer, GPT2BPETokenizer
from tools import build_demo_corpus, preprocess_data

GOOD = ["hello world", "", "café 日本 👍", "line one\nline two\n\ttabbed"]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def run(argv):
    assert preprocess_data.main([str(a) for a in argv]) == 0


def test_byte_tokenizer_end_to_end_with_bad_lines(tmp_path, capsys):
    rows = [{"text": GOOD[0]}, "{not json", {"text": GOOD[1]}, {"other": "x"}, "", {"text": 7},
            {"text": GOOD[2], "extra": 1}, "[1, 2]", {"text": GOOD[3]}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    run(["--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == 4
    for i, text in enumerate(GOOD):
        assert ds[i].tolist() == list(text.encode("utf-8")) + [ByteTokenizer.eod]
    out, err = capsys.readouterr()
    assert "documents: 4, tokens: 57," in out and "tokens/s" in out
    assert "skipped 5 bad line(s)" in err
    for fragment in ["line 2: invalid JSON", "line 4: missing key 'text'", "line 6: key 'text' holds int",
                     "line 8: expected a JSON object, got list", "line 10: not UTF-8"]:
        assert fragment in err


def test_strict_stops_at_first_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}, {"txt": "c"}])
    with pytest.raises(SystemExit, match=r"in\.jsonl:3: missing key 'text'"):
        preprocess_data.main(["--input", path, "--output-prefix", str(tmp_path / "o"),
                              "--tokenizer-type", "ByteTokenizer", "--strict"])
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]  # no partial output left behind


def test_existing_output_is_not_overwritten(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    argv = ["--input", path, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteTokenizer"]
    run(argv)
    with pytest.raises(SystemExit, match=r"o_text_document\.bin already exists; pass --overwrite"):
        run(argv)
    write_jsonl(tmp_path / "in.jsonl", [{"text": "abcd"}])
    run(argv + ["--overwrite"])
    assert IndexedDataset(str(tmp_path / "o_text_document"))[0].tolist() == list(b"abcd")


def test_gzip_input_and_several_keys(tmp_path):
    rows = [{"title": f"t{i}", "body": "b" * i} for i in range(5)]
    with gzip.open(tmp_path / "in.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    run(["--input", tmp_path / "in.jsonl.gz", "--json-keys", "title", "body", "--output-prefix", tmp_path / "o",
         "--tokenizer-type", "ByteTokenizer"])
    titles, bodies = IndexedDataset(str(tmp_path / "o_title_document")), IndexedDataset(str(tmp_path / "o_body_document"))
    assert [bytes(titles[i].tolist()).decode() for i in range(5)] == [r["title"] for r in rows]
    assert bodies.sequence_lengths.tolist() == [0, 1, 2, 3, 4]


def test_missing_tokenizer_file_names_flag(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(SystemExit, match=r"--vocab-file .*nope\.json: no such file"):
        preprocess_data.main(["--input", path, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                              "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "nope.json"),
                              "--merge-file", str(tmp_path / "m.txt")])


@pytest.fixture(scope="module")
def demo_bpe(tmp_path_factory):
    """A slice of the demo corpus and a byte-level BPE trained on it by Hugging Face tokenizers."""
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("demo")
    corpus = directory / "corpus.jsonl"
    build_demo_corpus.main(["--output", str(corpus), "--max-docs", "40", "--max-bytes", "300000"])
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    hf = ByteLevelBPETokenizer()
    hf.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    hf.save_model(str(directory))
    return corpus, texts, directory / "vocab.json", directory / "merges.txt"


def test_two_workers_equal_one_and_match_hugging_face(demo_bpe, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    corpus, texts, vocab, merges = demo_bpe
    common = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
              "--merge-file", merges, "--append-eod", "--chunk-lines", "3"]
    run(common + ["--output-prefix", tmp_path / "one", "--workers", "1"])
    run(common + ["--output-prefix", tmp_path / "two", "--workers", "2"])
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{suffix}").read_bytes()
        assert one == (tmp_path / f"two_text_document{suffix}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "one_text_document"))
    eod = GPT2BPETokenizer(str(vocab), str(merges)).eod
    reference = ByteLevelBPETokenizer(str(vocab), str(merges))
    assert len(ds) == len(texts) > 10
    for i in (0, len(texts) // 2, len(texts) - 1):
        assert ds[i].tolist() == reference.encode(texts[i]).ids + [eod]


def test_runs_as_a_script(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "xyz"}])
    script = os.path.join(os.path.dirname(preprocess_data.__file__), "preprocess_data.py")
    proc = subprocess.run([sys.executable, script, "--input", path, "--output-prefix",
                           str(tmp_path / "s"), "--tokenizer-type", "ByteTokenizer"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "documents: 1, tokens: 3," in proc.stdout
