import gzip
import json
import random
import re

import pytest

from megatron_p2r.config import DataConfig
from megatron_p2r.data.tokenizers import build_tokenizer
from tests.helpers import bad_input_error
from tools import train_tokenizer

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
PROSE = "The pseudo giant shares its layers; the real model gets its own copies. Ça marche très bien."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    with open(directory / "a.jsonl", "w", encoding="utf-8") as f:
        for i in range(60):
            prose = " ".join(rng.choice(words) for _ in range(40))
            f.write(json.dumps({"text": CODE.replace("add", rng.choice(words)) + PROSE + "\n" + prose}) + "\n")
        f.write("{broken\n")
        f.write(json.dumps({"title": "no text key"}) + "\n")
    with gzip.open(directory / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write((PROSE + "\n") * 30)
    return directory


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_load_round_trip(corpus, tmp_path, model_type, capsys):
    prefix = tmp_path / "tok" / "m"
    assert (
        train_tokenizer.main(
            [
                "--input",
                str(corpus / "a.jsonl"),
                str(corpus / "b.txt.gz"),
                "--model-prefix",
                str(prefix),
                "--vocab-size",
                "400",
                "--model-type",
                model_type,
                "--num-threads",
                "1",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "a.jsonl:61" in err and "a.jsonl:62" in err and "skipped 2 bad jsonl line(s)" in err
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=f"{prefix}.model"))
    assert tok.vocab_size == 400 and tok.eod == 2 and tok.pad == 3
    for text in [CODE, PROSE, CODE + PROSE, "unseen ∮ ☃ 漢字 \t\t  spaces"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # byte fallback + identity normalisation: exact round trip
    assert len(tok.encode(PROSE)) < len(PROSE) / 1.5  # pieces, not characters


def test_refuses_to_overwrite(corpus, tmp_path, capsys):
    argv = [
        "--input",
        str(corpus / "b.txt.gz"),
        "--model-prefix",
        str(tmp_path / "m"),
        "--vocab-size",
        "300",
        "--num-threads",
        "1",
    ]
    (tmp_path / "m.model").write_bytes(b"keep me")
    assert "m.model already exists" in bad_input_error(train_tokenizer.main, argv, capsys)
    assert (tmp_path / "m.model").read_bytes() == b"keep me"
    line = bad_input_error(
        train_tokenizer.main, ["--input", tmp_path / "missing.txt", "--model-prefix", tmp_path / "x"], capsys
    )
    assert re.search(r"--input .*missing\.txt: no such file", line)
