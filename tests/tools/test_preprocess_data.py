import gzip
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron_p2r.data.indexed_dataset import IndexedDataset
from megatron_p2r.data.tokenizers import ByteTokenizer, GPT2BPETokenizer
from tests.helpers import bad_input_error
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
    rows = [
        {"text": GOOD[0]},
        "{not json",
        {"text": GOOD[1]},
        {"other": "x"},
        "",
        {"text": 7},
        {"text": GOOD[2], "extra": 1},
        "[1, 2]",
        {"text": GOOD[3]},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    run(["--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-type", "ByteTokenizer", "--append-eod"])
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    # the empty text is a document without a sequence (and without an eod), as in Megatron-LM
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.document_indices.tolist() == [0, 1, 1, 2, 3]
    for i, text in enumerate(t for t in GOOD if t):
        assert ds[i].tolist() == list(text.encode("utf-8")) + [ByteTokenizer.eod]
    out, err = capsys.readouterr()
    assert "documents: 4, tokens: 56," in out and "tokens/s" in out and "empty texts: 1" in out
    assert "skipped 5 bad line(s)" in err
    for fragment in [
        "line 2: invalid JSON",
        "line 4: missing key 'text'",
        "line 6: key 'text' holds int",
        "line 8: expected a JSON object, got list",
        "line 10: not UTF-8",
    ]:
        assert fragment in err


def test_strict_stops_at_first_bad_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}, {"txt": "c"}])
    assert "in.jsonl:3: missing key 'text'" in bad_input_error(
        preprocess_data.main,
        ["--input", path, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteTokenizer", "--strict"],
        capsys,
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]  # no partial output left behind


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    argv = ["--input", path, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteTokenizer"]
    run(argv)
    assert "o_text_document.bin already exists; pass --overwrite" in bad_input_error(preprocess_data.main, argv, capsys)
    write_jsonl(tmp_path / "in.jsonl", [{"text": "abcd"}])
    run(argv + ["--overwrite"])
    assert IndexedDataset(str(tmp_path / "o_text_document"))[0].tolist() == list(b"abcd")


def test_gzip_input_and_several_keys(tmp_path):
    rows = [{"title": f"t{i}", "body": "b" * i} for i in range(5)]
    with gzip.open(tmp_path / "in.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    run(
        [
            "--input",
            tmp_path / "in.jsonl.gz",
            "--json-keys",
            "title",
            "body",
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "ByteTokenizer",
        ]
    )
    titles, bodies = (
        IndexedDataset(str(tmp_path / "o_title_document")),
        IndexedDataset(str(tmp_path / "o_body_document")),
    )
    assert [bytes(titles[i].tolist()).decode() for i in range(5)] == [r["title"] for r in rows]
    assert bodies.sequence_lengths.tolist() == [1, 2, 3, 4]
    assert bodies.document_indices.tolist() == [0, 0, 1, 2, 3, 4]


def test_missing_tokenizer_file_names_flag(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    line = bad_input_error(
        preprocess_data.main,
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            tmp_path / "nope.json",
            "--merge-file",
            tmp_path / "m.txt",
        ],
        capsys,
    )
    assert re.search(r"--vocab-file .*nope\.json: no such file", line)


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
    common = [
        "--input",
        corpus,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--append-eod",
        "--chunk-lines",
        "3",
    ]
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
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--input",
            path,
            "--output-prefix",
            str(tmp_path / "s"),
            "--tokenizer-type",
            "ByteTokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "documents: 1, tokens: 3," in proc.stdout


# --------------------------------------------------------------------------------------------------
# Megatron-LM's behaviour (main d98e8a64: tools/preprocess_data.py, core/datasets/indexed_dataset.py)


def megatron_preprocess(texts, tokenize, eod, append_eod, dtype):
    """The .bin and .idx bytes Megatron-LM writes for one json key, transcribed from
    Encoder.encode, IndexedDatasetBuilder.add_document and _IndexWriter.write."""
    data, sequence_lengths, document_indices = b"", [], [0]
    for text in texts:
        doc_ids, sentence_lens = [], []
        for sentence in [text]:
            sentence_ids = tokenize(sentence)
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0 and append_eod:
            doc_ids.append(eod)
            sentence_lens[-1] += 1
        data += np.array(doc_ids, dtype=dtype).tobytes(order="C")  # add_document(doc_ids, sentence_lens)
        sequence_lengths.extend(sentence_lens)
        document_indices.append(len(sequence_lengths))
    pointers, pointer = [], 0
    for length in sequence_lengths:
        pointers.append(pointer)
        pointer += length * np.dtype(dtype).itemsize
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(dtype)]
    index = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(sequence_lengths))
        + struct.pack("<Q", len(document_indices))
        + np.array(sequence_lengths, np.int32).tobytes()
        + np.array(pointers, np.int64).tobytes()
        + np.array(document_indices, np.int64).tobytes()
    )
    return data, index


EDGE_TEXTS = ["hello world", "", "a<|endoftext|>b", "  ", "<|endoftext|>", "", "the end"]


def test_empty_text_and_special_token_match_megatron(demo_bpe, tmp_path):
    """Byte-identical .bin/.idx to Megatron-LM main with GPT2BPETokenizer (HF GPT2TokenizerFast
    there): empty texts are documents without a sequence or eod; <|endoftext|> in text is eod."""
    from transformers import GPT2TokenizerFast

    _, _, vocab, merges = demo_bpe
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in EDGE_TEXTS])
    run(
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab,
            "--merge-file",
            merges,
            "--append-eod",
        ]
    )
    hf = GPT2TokenizerFast.from_pretrained(str(vocab.parent), local_files_only=True)
    data, index = megatron_preprocess(EDGE_TEXTS, lambda t: hf(t).input_ids, hf.eos_token_id, True, np.uint16)
    assert (tmp_path / "o_text_document.bin").read_bytes() == data
    assert (tmp_path / "o_text_document.idx").read_bytes() == index
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.num_documents == len(EDGE_TEXTS) and len(ds) == len(EDGE_TEXTS) - 2
    assert ds[1].tolist().count(hf.eos_token_id) == 2  # a<eod>b<eod>


def test_tiktoken_matches_megatrons_own_preprocessing(tmp_path):
    """--tokenizer-type TikTokenizer: byte-identical .bin/.idx to what Megatron-LM's own
    tools/preprocess_data.py (core_v0.16.1, run by tests/fixtures/tiktoken/make_fixture.py) wrote
    from the same corpus and vocabulary: special tokens in the text as ids, an empty text a
    document without a sequence, eod </s>; 2 workers change nothing."""
    pytest.importorskip("tiktoken")
    from tests.fixtures.tiktoken.make_fixture import FLAGS

    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "tiktoken")
    run(
        [
            "--input",
            os.path.join(fixture, "corpus.jsonl"),
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-model",
            os.path.join(fixture, "vocab.json"),
            "--workers",
            "2",
            "--chunk-lines",
            "3",
            *FLAGS,
        ]
    )
    for suffix in (".bin", ".idx"):
        with open(os.path.join(fixture, "megatron_text_document" + suffix), "rb") as f:
            assert (tmp_path / f"o_text_document{suffix}").read_bytes() == f.read()


def hf_tokenizer_dir(root):
    from tests.data.test_hf_tokenizer import LLAMA3_CONFIG, write_tokenizer

    return write_tokenizer(root / "hf", LLAMA3_CONFIG)


def test_hugging_face_tokenizer_equals_tokenizers_plus_eod(tmp_path):
    """--tokenizer-type HuggingFaceTokenizer: each document is `tokenizers`' own encoding of the
    text (bos from the post-processor, special tokens split out) + eod (the eos token)."""
    from tokenizers import Tokenizer

    from tests.data.test_hf_tokenizer import EOS, SAMPLES

    directory = hf_tokenizer_dir(tmp_path)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    texts = [t for t in SAMPLES if "pad" not in t] + ["the mat"] * 5
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    run(
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            directory,
            "--append-eod",
        ]
    )
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    eod = reference.token_to_id(EOS)
    assert [ds[i].tolist() for i in range(len(ds))] == [reference.encode(t).ids + [eod] for t in texts]


def test_hugging_face_options_reach_the_workers(tmp_path):
    """--special-tokens-in-text text and --tokenizer-hf-no-include-special-tokens, with 2 workers:
    no bos, <|end_of_text|> encoded as text, so the empty text is an empty document."""
    from tokenizers import Tokenizer

    from tests.data.test_hf_tokenizer import EOS

    directory = hf_tokenizer_dir(tmp_path)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    reference.encode_special_tokens = True
    texts = [f"a{EOS}b", "", "the cat"] * 3
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    run(
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            directory,
            "--special-tokens-in-text",
            "text",
            "--tokenizer-hf-no-include-special-tokens",
            "--workers",
            "2",
            "--chunk-lines",
            "2",
        ]
    )
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    expected = [reference.encode(t, add_special_tokens=False).ids for t in texts if t]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.num_documents == len(texts) and len(ds) == 6


def test_hugging_face_append_eod_needs_an_eos(tmp_path, capsys):
    from tests.data.test_hf_tokenizer import write_tokenizer

    directory = write_tokenizer(tmp_path / "hf")  # no tokenizer_config.json: no eos token named
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    line = bad_input_error(
        preprocess_data.main,
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            directory,
            "--append-eod",
        ],
        capsys,
    )
    assert re.search(r"--append-eod: --tokenizer-model .*hf names no eos token", line)


def test_null_tokenizer_preprocess(tmp_path, capsys):
    rows = [{"text": "1 2 3"}, {"text": ""}, {"text": "7 x"}, {"text": "0 9"}, {"text": "10"}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    run(
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "10",
            "--append-eod",
        ]
    )
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 9], [0, 9, 9]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    err = capsys.readouterr().err
    assert "line 3: NullTokenizer expects integers" in err and "line 5: token id 10 is outside [0, 10)" in err


def test_llama2_tokenizer_preprocess(tmp_path):
    """bos starts every document, eos (eod) ends it; an empty text is [bos, eos], as Megatron's
    _Llama2Tokenizer gives it a token."""
    import sentencepiece

    lines = ["the cat sat on the mat", "a dog and a log"] * 50
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    texts = ["the cat", "", "a log"]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    run(
        [
            "--input",
            path,
            "--output-prefix",
            tmp_path / "o",
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            tmp_path / "sp.model",
            "--append-eod",
        ]
    )
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[sp.bos_id()] + sp.encode(t) + [sp.eos_id()] for t in texts]


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "no text in it"),
        (b"\n  \n", "no text in it"),
        (bytes(range(256)) * 64, "none of its"),
        (b'{"txt": "a"}\n[1]\n', "none of its 2 non-blank lines"),
    ],
)
def test_an_input_without_a_document_is_an_error_and_writes_nothing(tmp_path, capsys, content, reason):
    (tmp_path / "in.jsonl").write_bytes(content)
    line = bad_input_error(
        preprocess_data.main,
        [
            "--input",
            tmp_path / "in.jsonl",
            "--output-prefix",
            tmp_path / "out" / "c",
            "--tokenizer-type",
            "ByteTokenizer",
        ],
        capsys,
    )
    assert reason in line and "nothing was written" in line
    assert not os.listdir(tmp_path / "out")


def test_an_over_long_line_is_a_bad_line_read_in_bounded_pieces(tmp_path, capsys):
    long = json.dumps({"text": "x" * 5000}).encode()
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "short"}\n' + long + b'\n{"text": "after"}\n')
    run(
        [
            "--input",
            tmp_path / "in.jsonl",
            "--output-prefix",
            tmp_path / "c",
            "--tokenizer-type",
            "ByteTokenizer",
            "--max-line-bytes",
            "1000",
        ]
    )
    assert "line 2: longer than --max-line-bytes" in capsys.readouterr().err
    ds = IndexedDataset(str(tmp_path / "c_text_document"))
    assert [bytes(ds[i].tolist()).decode() for i in range(len(ds))] == ["short", "after"]


def test_a_single_line_file_longer_than_the_limit_is_one_error_line(tmp_path, capsys):
    """Issue 38: a 200 MB jsonl of one line, no newline (here 5 kB against --max-line-bytes 1000):
    read past in bounded pieces, then one error line; nothing written."""
    (tmp_path / "in.jsonl").write_bytes(json.dumps({"text": "x" * 5000}).encode())
    line = bad_input_error(
        preprocess_data.main,
        [
            "--input",
            tmp_path / "in.jsonl",
            "--output-prefix",
            tmp_path / "out" / "c",
            "--tokenizer-type",
            "ByteTokenizer",
            "--max-line-bytes",
            "1000",
        ],
        capsys,
    )
    assert "none of its 1 non-blank lines" in line and "line 1: longer than --max-line-bytes" in line
    assert not os.listdir(tmp_path / "out")
