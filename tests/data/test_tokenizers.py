import dataclasses
import json

import pytest

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.tokenizers import (
    TOKENIZER_TYPES,
    ByteTokenizer,
    GPT2BPETokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    SpecialTokens,
    TextEncodingError,
    build_tokenizer,
)

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
    hf.train_from_iterator(
        TRAIN_TEXTS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
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


EOD_TEXTS = [
    "a<|endoftext|>b",
    "<|endoftext|>",
    " hello<|endoftext|> world",
    "x <|endoftext|><|endoftext|>y",
    "<|endoftext|<|endoftext|>>",
    "no special token here",
]


def test_gpt2_bpe_special_token_in_text(bpe_files):
    """Default: a literal <|endoftext|> is the eod id, as in Megatron-LM main (HF GPT2TokenizerFast
    from the same files); "text": encoded like other text, as GPT-2 and Megatron-LM <= core_v0.14."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    directory = bpe_files[0].rsplit("/", 1)[0]
    megatron_main = GPT2TokenizerFast.from_pretrained(directory, local_files_only=True)
    as_text = ByteLevelBPETokenizer(*bpe_files)
    ours = build_tokenizer(
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    )
    plain = GPT2BPETokenizer(*bpe_files, special_tokens_in_text="text")
    for text in EOD_TEXTS:
        assert ours.encode(text) == megatron_main(text).input_ids
        assert plain.encode(text) == as_text.encode(text).ids
    assert ours.encode("a<|endoftext|>b")[1] == ours.eod
    assert ours.eod not in plain.encode("a<|endoftext|>b")


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
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
        num_threads=1,
    )
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
        build_tokenizer(
            DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
        )
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00not a model")
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*garbage\.model"):
        SentencePieceTokenizer(str(garbage))
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer"))


def test_special_tokens_split_as_hugging_face_does():
    """Overlapping special tokens: leftmost match, longest there, as `tokenizers` splits added tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars, specials = "xy<>abc", ["<a>", "<a><b>", "b><c"]
    reference = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="x"))
    reference.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one id per character
    reference.add_special_tokens(specials)
    ours = SpecialTokens({t: reference.token_to_id(t) for t in specials})
    for text in ["x<a><b>y", "x<a>y", "<a><b><c", "<a>b><c", "", "<a><a><b>b><c<", "plain"]:
        assert (
            ours.encode(text, lambda s: [chars.index(c) if c in chars else 0 for c in s]) == reference.encode(text).ids
        )


def test_sentencepiece_special_tokens_in_text(sp_model):
    """Default (Megatron-LM main: plain encode_as_ids): "</s>" in text is text; "id": the control
    pieces and <unk> written in text become their ids, the rest is encoded piece by piece."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    cfg = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model)
    default, as_id = build_tokenizer(cfg), build_tokenizer(cfg, special_tokens_in_text="id")
    text = "the cat</s>sat <s><unk>"
    assert default.encode(text) == sp.encode_as_ids(text)
    assert 2 not in default.encode(text)
    assert as_id.encode(text) == sp.encode_as_ids("the cat") + [2] + sp.encode_as_ids("sat ") + [1, 0]
    assert as_id.encode_batch([text, "x"]) == [as_id.encode(text), as_id.encode("x")]


def test_llama2_tokenizer_conventions(sp_model, tmp_path):
    """Megatron-LM's _Llama2Tokenizer: tokenize(s) = [bos] + sp.encode(s) (no eos), eod = eos,
    vocab = the model's pieces."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)

    def megatron_tokenize(s, bos=True, eos=False):  # transcribed from _Llama2Tokenizer.tokenize
        t = sp.encode(s)
        if bos:
            t = [sp.bos_id()] + t
        if eos:
            t = t + [sp.eos_id()]
        return t

    tok = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model))
    assert isinstance(tok, Llama2Tokenizer)
    assert (tok.vocab_size, tok.bos, tok.eod) == (sp.get_piece_size(), sp.bos_id(), sp.eos_id()) == (400, 1, 2)
    texts = list(SAMPLES.values()) + ["", "the cat</s>"]
    for text in texts:
        assert tok.encode(text) == megatron_tokenize(text)
    assert tok.encode_batch(texts) == [megatron_tokenize(t) for t in texts]
    assert tok.decode(tok.encode("the cat")) == "the cat"
    lines = [line for text in TRAIN_TEXTS for line in text.split("\n") if line.strip()]
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_prefix=str(tmp_path / "nobos"),
        vocab_size=100,
        bos_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*nobos\.model: Llama2Tokenizer needs .*<s>"):
        Llama2Tokenizer(str(tmp_path / "nobos.model"))


def test_null_tokenizer():
    """Megatron-LM main's NullTokenizer: [int(x) for x in text.split(' ')], vocab = --vocab-size,
    eod = vocab - 1. An empty text is no tokens (Megatron would fail on int(''))."""
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert tok.encode("5 0 99 17") == [5, 0, 99, 17]
    assert tok.encode("") == []
    assert tok.decode([5, 0, 99]) == "5 0 99"
    assert tok.encode_batch(["1 2", "3"]) == [[1, 2], [3]]
    for bad, message in [
        ("1  2", "single spaces"),
        ("1 x", "single spaces"),
        ("1 100", r"100 is outside \[0, 100\)"),
        ("-1", "outside"),
    ]:
        with pytest.raises(TextEncodingError, match=message):
            tok.encode(bad)
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


def test_tokenizer_types_are_the_config_choices():
    choices = {f.name: f for f in dataclasses.fields(DataConfig)}["tokenizer_type"].metadata["choices"]
    assert sorted(TOKENIZER_TYPES) == sorted(choices)


def test_megatron_names_for_our_tokenizers(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model))
    assert type(tok) is SentencePieceTokenizer and tok.eod == 2
    assert tok.encode("the cat") == SentencePieceTokenizer(sp_model).encode("the cat")


def test_unknown_tokenizer_type():
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer(DataConfig())
    with pytest.raises(ConfigError, match="--special-tokens-in-text"):
        build_tokenizer(DataConfig(tokenizer_type="ByteTokenizer"), special_tokens_in_text="both")


def test_training_takes_null_tokenizer_size_from_vocab_size_flag():
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.training import resolve_vocab

    cfg = resolve_vocab(config_from_values({"tokenizer_type": "NullTokenizer", "vocab_size": 100, "mock_data": True}))
    assert cfg.model.vocab_size == 100 and build_tokenizer(cfg.data, vocab_size=100).eod == 99
