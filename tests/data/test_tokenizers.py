import json

import pytest

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.tokenizers import ByteTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, build_tokenizer

SAMPLES = {
    "ascii": "The quick brown fox jumps over the lazy dog. def f(x): return x + 1",
    "accents": "café naïve résumé Ünïcödé façade jalapeño",
    "cjk": "日本語のテキスト 中文字符 한국어 문장",
    "emoji": "emoji 👍🏽 family 👨‍👩‍👧 party 🎉🎉",
    "whitespace": "a  b\t\t c\n\n  d   \n\t \r\n   end    ",
    "contractions": "I'm you're they've it's we'll he'd don't I'M 'S",
    "numbers": "1234567 3.14159 ١٢٣ ½ 2nd",
}
TRAIN_TEXTS = list(SAMPLES.values()) * 20 + [
    "the cat sat on the mat and the dog sat on the log " * 5,
    "for i in range(10):\n    print(i, i ** 2)\n" * 5,
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """vocab.json / merges.txt of a tiny byte-level BPE trained by Hugging Face tokenizers."""
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("bpe")
    hf = ByteLevelBPETokenizer()
    hf.train_from_iterator(TRAIN_TEXTS, vocab_size=400, min_frequency=2,
                           special_tokens=["<|endoftext|>"], show_progress=False)
    hf.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_gpt2_bpe_matches_hugging_face(bpe_files, name):
    from tokenizers import ByteLevelBPETokenizer

    text = SAMPLES[name]
    ours = GPT2BPETokenizer(*bpe_files)
    reference = ByteLevelBPETokenizer(*bpe_files)
    ids = ours.encode(text)
    assert ids == reference.encode(text).ids
    assert len(ids) < len(text.encode("utf-8"))  # merges were applied, not just bytes
    assert ours.decode(ids) == text


def test_gpt2_bpe_specials_and_batch(bpe_files):
    tok = GPT2BPETokenizer(*bpe_files)
    vocab = json.load(open(bpe_files[0], encoding="utf-8"))
    assert tok.vocab_size == len(vocab) == 400
    assert tok.eod == tok.pad == vocab["<|endoftext|>"]
    texts = list(SAMPLES.values())
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode("") == []


def test_gpt2_bpe_file_errors_name_flag_and_file(bpe_files, tmp_path):
    vocab, merges = bpe_files
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(ConfigError, match=r"--vocab-file .*vocab\.json"):
        GPT2BPETokenizer(str(bad_json), merges)
    no_eod = tmp_path / "noeod.json"
    no_eod.write_text(json.dumps({"a": 0}))
    with pytest.raises(ConfigError, match=r"--vocab-file .*noeod\.json.*endoftext"):
        GPT2BPETokenizer(str(no_eod), merges)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ConfigError, match=r"--merge-file .*merges\.txt: line 2"):
        GPT2BPETokenizer(vocab, str(bad_merges))
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match=r"--merge-file .*missing\.txt: no such file"):
        build_tokenizer(cfg)
    with pytest.raises(ConfigError, match="needs --vocab-file"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", merge_file=merges))


def test_byte_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="ByteTokenizer"))
    assert isinstance(tok, ByteTokenizer)
    text = SAMPLES["emoji"] + SAMPLES["cjk"]
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.vocab_size == 258 and {tok.eod, tok.pad} == {256, 257}
    assert tok.decode(ids + [tok.eod, tok.pad]) == text
    assert tok.encode_batch(["a", "é"]) == [[97], [0xC3, 0xA9]]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece

    prefix = tmp_path_factory.mktemp("sp") / "m"
    lines = [line for text in TRAIN_TEXTS for line in text.split("\n") if line.strip()]
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2, num_threads=1)
    return str(prefix) + ".model"


def test_sentencepiece_round_trip(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (400, 2, 3)
    texts = list(SAMPLES.values()) + ["never seen: ☃ Ω ∑"]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert len(tok.encode(SAMPLES["ascii"])) < len(SAMPLES["ascii"])


def test_sentencepiece_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*nope\.model: no such file"):
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model")))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00not a model")
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*garbage\.model"):
        SentencePieceTokenizer(str(garbage))
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer"))


def test_unknown_tokenizer_type():
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer(DataConfig())
