"""``--tokenizer-type HuggingFaceTokenizer``: a Hugging Face ``tokenizer.json`` read with the
``tokenizers`` library from local files only (never ``transformers``, never the Hub).

Megatron-LM's HuggingFaceTokenizer is transformers' ``AutoTokenizer``, which adds to
``tokenizer.json`` what the files beside it say. The generic fast tokenizer's rules
(transformers 5) are reproduced here: which tokens are eos/bos/pad (``tokenizer_config.json``,
and the legacy ``special_tokens_map.json`` when the config lists no ``added_tokens_decoder``),
and those tokens registered as special (added at the end of the vocabulary when missing).
``tokenizer.json``'s post-processor decides which tokens frame a text (transformers 5 drops
the config's ``add_bos_token``/``add_eos_token`` when a tokenizer.json exists).
"""

from __future__ import annotations

import os
import reprlib
from typing import Dict, Iterable, List

from megatron_p2r.config import ConfigError
from megatron_p2r.files import read_json

ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_json_path(path: str) -> str:
    """``path`` itself, or ``path/tokenizer.json`` for a directory; nothing is looked up remotely."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise ConfigError(
                f"--tokenizer-model {path}: no tokenizer.json in this directory (HuggingFaceTokenizer "
                "reads a Hugging Face fast tokenizer; for a SentencePiece tokenizer.model use "
                "--tokenizer-type Llama2Tokenizer or SentencePieceTokenizer)"
            )
        return candidate
    if not os.path.isfile(path):
        raise ConfigError(
            f"--tokenizer-model {path}: no such file or directory (HuggingFaceTokenizer reads local "
            "files only: a directory holding tokenizer.json, or that file)"
        )
    return path


def _read_json(path: str) -> dict:
    """A JSON object beside tokenizer.json ({} when absent), read through the project's bounded
    reader: size, nesting depth and duplicate keys are checked, so a crafted file is an error."""
    if not os.path.exists(path):
        return {}
    try:
        data = read_json(path, ConfigError)
    except OSError as exc:
        raise ConfigError(f"--tokenizer-model: cannot read {path} ({exc.strerror})") from None
    except ConfigError as exc:
        raise ConfigError(f"--tokenizer-model: cannot read {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--tokenizer-model: {path} is not a JSON object")
    return data


def _token_text(value, path: str, role: str) -> str:
    """A role's token as written by transformers: a string or an AddedToken dict with "content"."""
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str) or not text:
        raise ConfigError(
            f"--tokenizer-model: {path}: {role} must be a token string or an object with "
            f'"content", got {reprlib.repr(value)}'
        )
    return text


def special_token_roles(directory: str) -> Dict[str, str]:
    """{role: token}, e.g. {"eos_token": "</s>"}, from the files transformers reads."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_path)
    roles = {role: _token_text(config[role], config_path, role) for role in ROLES if config.get(role)}
    if "added_tokens_decoder" not in config:  # transformers reads the legacy map only then
        legacy_path = os.path.join(directory, "special_tokens_map.json")
        legacy = _read_json(legacy_path)
        roles.update({role: _token_text(legacy[role], legacy_path, role) for role in ROLES if legacy.get(role)})
    return roles


class HuggingFaceTokenizer:
    """eod is the eos token (else sep, as Megatron-LM), bos the bos token (else cls), pad the pad
    token (else eod); vocab_size counts added tokens (``len(tokenizer)`` in transformers). Text is
    encoded with the post-processor's special tokens unless ``add_special_tokens`` is False."""

    def __init__(self, path: str, special_tokens_in_text: str = "id", add_special_tokens: bool = True):
        from tokenizers import AddedToken, Tokenizer

        self.path = tokenizer_json_path(path)
        try:
            self._tokenizer = Tokenizer.from_file(self.path)
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ConfigError(f"--tokenizer-model {self.path}: not a Hugging Face tokenizer.json ({exc})") from None
        roles = special_token_roles(os.path.dirname(self.path))
        registered = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        unregistered = [t for t in dict.fromkeys(roles.values()) if t not in registered]
        self._tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in unregistered])
        self._tokenizer.encode_special_tokens = special_tokens_in_text == "text"
        self.add_special_tokens = add_special_tokens
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        ids = {role: self._tokenizer.token_to_id(token) for role, token in roles.items()}
        self.eod = ids.get("eos_token", ids.get("sep_token"))
        self.bos = ids.get("bos_token", ids.get("cls_token"))
        self.pad = ids.get("pad_token", self.eod)

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        texts = list(texts)
        try:
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        except TypeError:  # what tokenizers raises for a str that is not valid Unicode (a lone surrogate)
            for text in texts:
                text.encode("utf-8")  # raises the UnicodeEncodeError that names the position
            raise
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
