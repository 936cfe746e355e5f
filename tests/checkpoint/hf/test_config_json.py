"""Reading HF config.json: the vocabulary padding chosen on import."""
from megatron_p2r.checkpoint.hf.config_json import import_vocab_divisor


def test_import_vocab_divisor_avoids_padding_when_tp_allows():
    assert import_vocab_divisor(208, 2) == 16 and import_vocab_divisor(201, 2) == 128
