"""HuggingFaceTokenizer (megatron_p2r/data/hf_tokenizer.py): a local tokenizer.json through
`tokenizers`, with the special-token roles transformers gives it (docs/data.md)."""

import json

import pytest

from megatron_p2r.config import ConfigError, DataConfig
from megatron_p2r.data.hf_tokenizer import HuggingFaceTokenizer
from megatron_p2r.data.tokenizers import build_tokenizer

TEXTS = ["the cat sat on the mat", "def f(x): return x + 1", "hello world, hello cat"] * 20
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SAMPLES = ["the cat", "", f"a{EOS}b", f"{BOS}{BOS} x {EOS}", f"mat{PAD}", "naïve 日本"]


def write_tokenizer(directory, config=None, bos_template=True):
    """A Llama-3-shaped tokenizer.json built with `tokenizers` (byte-level BPE, bos/eos as added
    special tokens, a post-processor putting bos first) and an optional tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[BOS, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


LLAMA3_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": PAD,
}  # the pad token is not in tokenizer.json: it is added


def test_encodes_as_tokenizers_with_transformers_roles(tmp_path):
    from tokenizers import Tokenizer

    directory = write_tokenizer(tmp_path / "tok", LLAMA3_CONFIG)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory)))
    base = reference.get_vocab_size(with_added_tokens=True)
    assert tok.vocab_size == base + 1  # the pad token, added at the end as transformers does
    assert (tok.bos, tok.eod, tok.pad) == (reference.token_to_id(BOS), reference.token_to_id(EOS), base)
    for text in SAMPLES[:-2]:  # texts without the (new) pad token encode as tokenizers does
        assert tok.encode(text) == reference.encode(text).ids
    assert tok.encode(f"a{EOS}b")[2] == tok.eod  # [bos, a, eos, b]: the special token is split out
    assert tok.encode(f"mat{PAD}")[-1] == tok.pad
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert tok.decode(tok.encode("the cat")) == BOS + "the cat"
    # the tokenizer.json file itself works too, with the config beside it
    same = HuggingFaceTokenizer(str(directory / "tokenizer.json"))
    assert (same.vocab_size, same.eod) == (tok.vocab_size, tok.eod)


def test_matches_transformers_autotokenizer(tmp_path):
    """What Megatron-LM's HuggingFaceTokenizer runs: AutoTokenizer(dir)(text).input_ids, len(),
    eos_token_id; and tokenize+convert for --tokenizer-hf-no-include-special-tokens."""
    transformers = pytest.importorskip("transformers")
    directory = write_tokenizer(tmp_path / "tok", LLAMA3_CONFIG)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    cfg = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory))
    tok = build_tokenizer(cfg)
    plain = build_tokenizer(cfg, hf_add_special_tokens=False)
    as_text = build_tokenizer(cfg, special_tokens_in_text="text")
    assert tok.vocab_size == len(reference)
    assert (tok.eod, tok.bos, tok.pad) == (reference.eos_token_id, reference.bos_token_id, reference.pad_token_id)
    for text in SAMPLES:
        assert tok.encode(text) == reference(text).input_ids
        assert plain.encode(text) == reference.convert_tokens_to_ids(reference.tokenize(text))
        assert as_text.encode(text) == reference(text, split_special_tokens=True).input_ids


def test_special_tokens_map_and_fallbacks(tmp_path):
    """Roles from the legacy special_tokens_map.json (AddedToken objects) when the config has no
    added_tokens_decoder; eos falls back to sep and bos to cls, as in Megatron-LM."""
    directory = write_tokenizer(tmp_path / "tok", {"unk_token": "<unk>"}, bos_template=False)
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"sep_token": {"content": EOS, "lstrip": False}, "cls_token": BOS})
    )
    tok = HuggingFaceTokenizer(str(directory))
    assert (tok.eod, tok.bos) == (tok._tokenizer.token_to_id(EOS), tok._tokenizer.token_to_id(BOS))
    assert tok.encode("") == [] and tok.encode("the")[0] != tok.bos
    ignored = write_tokenizer(tmp_path / "modern", {"added_tokens_decoder": {}}, bos_template=False)
    (ignored / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}))
    assert HuggingFaceTokenizer(str(ignored)).eod is None  # transformers ignores the map here too


def test_errors_name_the_flag_and_file(tmp_path):
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*nowhere: no such file or directory .*local"):
        HuggingFaceTokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*sp: no tokenizer\.json .*Llama2Tokenizer"):
        HuggingFaceTokenizer(str(tmp_path / "sp"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--tokenizer-model .*tokenizer\.json: not a Hugging Face tokenizer"):
        HuggingFaceTokenizer(str(tmp_path / "bad"))
    directory = write_tokenizer(tmp_path / "tok", {"eos_token": 5})
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: eos_token must be a token string"):
        HuggingFaceTokenizer(str(directory))
    (directory / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"cannot read .*tokenizer_config\.json"):
        HuggingFaceTokenizer(str(directory))
    with pytest.raises(ConfigError, match="HuggingFaceTokenizer needs --tokenizer-model"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer"))


def test_lone_surrogate_is_a_unicode_error(tmp_path):
    tok = HuggingFaceTokenizer(str(write_tokenizer(tmp_path / "tok", LLAMA3_CONFIG)))
    with pytest.raises(UnicodeEncodeError):
        tok.encode_batch(["fine", "bad \ud800"])


DEEP = "[" * 100_000 + "]" * 100_000  # json's recursive decoder gives up long before this depth


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
def test_deeply_nested_side_files_are_an_error_not_a_recursion(tmp_path, capsys, name):
    """Both side files go through the bounded JSON reader: in the tokenizer, in import-hf's
    tokenizer search (a note; the weights still import) and in pretrain_m6.py (an error: line)."""
    import pretrain_m6
    from megatron_p2r.convert.hf.tokenizer import find_tokenizer

    directory = write_tokenizer(tmp_path / "tok")
    (directory / name).write_text('{"eos_token": ' + DEEP + "}")
    message = rf"--tokenizer-model: cannot read .*{name}: not valid JSON \(nested too deeply\)"
    with pytest.raises(ConfigError, match=message):
        HuggingFaceTokenizer(str(directory))
    found, note = find_tokenizer(str(directory))
    assert found is None and "nested too deeply" in note, note
    rc = pretrain_m6.main(
        [
            "--mock-data",
            "--num-layers",
            "1",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "1",
            "--device",
            "cpu",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(directory),
        ]
    )
    err = capsys.readouterr().err
    assert rc in (1, 2) and "error:" in err and "nested too deeply" in err and "Traceback" not in err, err


def test_deeply_nested_gpt2_vocabulary_is_an_error(tmp_path):
    (tmp_path / "vocab.json").write_text(DEEP)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(
        ConfigError,
        match=r"--vocab-file .*vocab\.json: cannot read a JSON vocabulary \(not valid JSON \(nested too deeply",
    ):
        build_tokenizer(
            DataConfig(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=str(tmp_path / "vocab.json"),
                merge_file=str(tmp_path / "merges.txt"),
            )
        )
