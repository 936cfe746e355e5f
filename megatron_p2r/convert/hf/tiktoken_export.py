"""A TikTokenizer as a Hugging Face ``tokenizers`` fast tokenizer, through transformers' own
``TikTokenConverter`` (merges recovered from the ranks, byte-level, the same split pattern).

The converter reads a ``.tiktoken`` file and appends special tokens after the vocabulary;
Megatron's ids put the special tokens first (0..N-1) and shift every rank by N, so the ranks are
handed over in memory and the special tokens enter the vocabulary at their own ids."""

from __future__ import annotations

from transformers.convert_slow_tokenizer import TikTokenConverter


class _MegatronRanksConverter(TikTokenConverter):
    def __init__(self, tokenizer):
        super().__init__(pattern=tokenizer.encoding._pat_str, extra_special_tokens=tokenizer.special_tokens)
        self._tokenizer = tokenizer

    def load_tiktoken_bpe(self, tiktoken_url):  # noqa: ARG002 (the ranks are in memory, no file)
        return self._tokenizer.ranks

    def tokenizer(self):
        from tokenizers import Tokenizer
        from tokenizers.models import BPE

        vocab, merges = self.extract_vocab_merges_from_model(None)
        vocab.update(self._tokenizer.special_ids)  # ids 0..N-1: added below as special tokens, ids kept
        tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False))
        tokenizer.model.ignore_merges = True  # tiktoken takes a whole piece in the vocabulary as one token
        return tokenizer


def tiktoken_to_tokenizers(tokenizer):
    """A ``tokenizers.Tokenizer`` equal to ``tokenizer`` (a TikTokenizer) on every text."""
    return _MegatronRanksConverter(tokenizer).converted()
