"""--tokenizer-type TikTokenizer: Megatron-LM's tiktoken vocabulary, encoded by ``tiktoken``.

The fixture (tests/fixtures/tiktoken, make_fixture.py) is a vocabulary trained by tiktoken's own
``_educational.bpe_train`` in Megatron's JSON format. The reference encoding here is a
``tiktoken.Encoding`` built from that file with Megatron's documented layout written out literally:
special tokens at ids 0..N-1, rank r at id r + N."""

import base64
import json
import os

import pytest

from megatron_p2r.config import Config, ConfigError, DataConfig
from megatron_p2r.data.tokenizers import build_tokenizer

tiktoken = pytest.importorskip("tiktoken")

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "tiktoken")
VOCAB = os.path.join(FIXTURE, "vocab.json")
NUM_SPECIAL, VOCAB_SIZE = 12, 388  # make_fixture.py's flags
SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<mask>",
    "<pad>",
    "<cls>",
    "<sep>",
    "<SPECIAL_7>",
    "<SPECIAL_8>",
    "<SPECIAL_9>",
    "<SPECIAL_10>",
    "<SPECIAL_11>",
]
# Megatron-LM core_v0.16.1, megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py
V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
V2 = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}"
    "\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def corpus():
    with open(os.path.join(FIXTURE, "corpus.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f] + ["</s></s>x<SPECIAL_11>", "<SPECIAL_12>", "a\n\n\nb  c"]


def reference(pattern):
    with open(VOCAB, encoding="utf-8") as f:
        ranks = {base64.b64decode(e["token_bytes"]): e["rank"] + NUM_SPECIAL for e in json.load(f)}
    return tiktoken.Encoding(
        name="reference", pat_str=pattern, mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(SPECIALS)}
    )


def tik(**values):
    data = DataConfig(
        tokenizer_type="TikTokenizer",
        tokenizer_model=values.pop("model", VOCAB),
        tiktoken_num_special_tokens=NUM_SPECIAL,
        **values,
    )
    return data, build_tokenizer(data, vocab_size=VOCAB_SIZE)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_encoding_equals_tiktoken(pattern):
    """Every text as tiktoken encodes it (special tokens in text as their ids, Megatron's
    allowed_special="all"; as text with --special-tokens-in-text text); decode inverts it."""
    _, ours = tik(tiktoken_pattern=pattern)
    ref = reference(V1 if pattern == "v1" else V2)
    texts = corpus()
    assert [ours.encode(t) for t in texts] == [ref.encode(t, allowed_special="all") for t in texts]
    assert ours.encode("</s>") == [2] and ours.encode("<SPECIAL_11>") == [11]
    plain = build_tokenizer(
        DataConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=VOCAB,
            tiktoken_pattern=pattern,
            tiktoken_num_special_tokens=NUM_SPECIAL,
        ),
        VOCAB_SIZE,
        "text",
    )
    assert [plain.encode(t) for t in texts] == [ref.encode_ordinary(t) for t in texts]
    assert all(ours.decode(ours.encode(t)) == t for t in texts)


def test_ids_and_defaults():
    """eod </s>, bos <s>, pad <pad>; the default pattern is v2; --vocab-size cuts the vocabulary."""
    _, ours = tik()
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad, ours.unk) == (VOCAB_SIZE, 2, 1, 4, 0)
    assert ours.pattern == "v2"
    cut = build_tokenizer(
        DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=VOCAB, tiktoken_num_special_tokens=NUM_SPECIAL),
        vocab_size=NUM_SPECIAL + 256,
    )
    assert cut.vocab_size == NUM_SPECIAL + 256 and max(cut.encode("the the then")) < NUM_SPECIAL + 256
    custom = build_tokenizer(
        DataConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=VOCAB,
            tiktoken_num_special_tokens=NUM_SPECIAL,
            tiktoken_special_tokens=["<eot>"] + SPECIALS[:7],
        ),
        vocab_size=VOCAB_SIZE,
    )
    assert custom.encode("<eot></s><SPECIAL_8>") == [0, 3, 8] and custom.eod == 3


@pytest.mark.parametrize(
    "values, vocab_size, message",
    [
        ({"tiktoken_special_tokens": ["<unk>", "<s>", "</s>"]}, VOCAB_SIZE, "must include .* missing <mask> <pad>"),
        ({"tiktoken_num_special_tokens": 5}, VOCAB_SIZE, "--tiktoken-num-special-tokens 5 must be >= the 7"),
        ({}, None, r"holds 376 tokens, fewer than --vocab-size 131072 .*pass --vocab-size 388 or less"),
        ({"tiktoken_pattern": "v3"}, VOCAB_SIZE, "--tiktoken-pattern must be v1 or v2"),
    ],
)
def test_bad_settings_name_the_flag(values, vocab_size, message):
    data = DataConfig(
        tokenizer_type="TikTokenizer", tokenizer_model=VOCAB, **{"tiktoken_num_special_tokens": NUM_SPECIAL, **values}
    )
    with pytest.raises(ConfigError, match=message):
        build_tokenizer(data, vocab_size=vocab_size)


def test_bad_vocabulary_files(tmp_path):
    for content, message in [
        ("{}", "expected a JSON list"),
        ('[{"rank": 1}]', "entry 0 is not"),
        ('[{"rank": 0, "token_bytes": "AQ==", "token_str": ""}]', "entry 0: token .* is not the single byte 0"),
        ("not json", "not a JSON tiktoken vocabulary"),
    ]:
        path = tmp_path / "v.json"
        path.write_text(content)
        with pytest.raises(ConfigError, match=f"--tokenizer-model {path}: {message}"):
            tik(model=str(path))


def test_checkpoint_records_the_tokenizer():
    """The checkpoint's config (metadata "config") holds the TikToken flags; an older record
    without them reads with Megatron's defaults."""
    data, _ = tik(tiktoken_pattern="v1", tiktoken_special_tokens=SPECIALS[:7])
    cfg = Config(data=data)
    again = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.data == data
    older = cfg.to_dict()
    for key in ("tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens"):
        del older["data"][key]
    assert Config.from_dict(older).data.tiktoken_num_special_tokens == 1000


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_hf_export_encodes_as_tiktoken(tmp_path, pattern):
    """The export's tokenizer.json (transformers' TikTokenConverter, specials at ids 0..N-1) loads
    with AutoTokenizer and encodes every text as the run did."""
    transformers = pytest.importorskip("transformers")
    from megatron_p2r.convert.hf.tokenizer import export_tokenizer

    data, ours = tik(tiktoken_pattern=pattern)
    cfg = Config(data=data).replace(vocab_size=VOCAB_SIZE)
    line, ids = export_tokenizer(cfg, str(tmp_path))
    assert line.startswith("tokenizer: PreTrainedTokenizerFast") and ids == {"bos": 1, "eos": 2, "pad": 4}
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = corpus()
    assert [hf.encode(t, add_special_tokens=False) for t in texts] == [ours.encode(t) for t in texts]
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id, len(hf)) == (2, 1, 4, VOCAB_SIZE)


def test_training_flags_resolve_the_vocabulary():
    """pretrain_m6's flags (Megatron's names) build the tokenizer; the model's vocabulary is its size."""
    from megatron_p2r.arguments import parse_args
    from megatron_p2r.training import resolve_vocab

    cfg = parse_args(
        [
            "--tokenizer-type",
            "TikTokenizer",
            "--tokenizer-model",
            VOCAB,
            "--tiktoken-pattern",
            "v1",
            "--tiktoken-num-special-tokens",
            str(NUM_SPECIAL),
            "--tiktoken-special-tokens",
            *SPECIALS[:7],
            "--vocab-size",
            str(VOCAB_SIZE),
            "--mock-data",
            "--num-layers",
            "2",
            "--hidden-size",
            "8",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "16",
            "--max-position-embeddings",
            "16",
            "--micro-batch-size",
            "1",
            "--train-iters",
            "1",
        ]
    )
    assert cfg.data.tiktoken_pattern == "v1" and cfg.data.tiktoken_special_tokens == SPECIALS[:7]
    assert resolve_vocab(cfg).model.vocab_size == VOCAB_SIZE


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(
        ConfigError, match=r"TikTokenizer needs the tiktoken package: pip install megatron_p2r\[tiktoken\]"
    ):
        tik()
