"""`--tokenizer-type HuggingFaceTokenizer`: a local Hugging Face fast tokenizer (`tokenizer.json`).

`--tokenizer-model` is a directory holding `tokenizer.json` (as written by `save_pretrained`) or the path of a
`tokenizer.json` itself. It is loaded with the `tokenizers` library from local disk; nothing is downloaded, and a
hub model name is rejected with a message. The special tokens (eos, bos, pad) come from the directory's
`tokenizer_config.json` or `special_tokens_map.json`, as `transformers` reads them; without either, the usual
names (`</s>`, `<|endoftext|>`, ...) are looked up among the tokenizer's special tokens. `chat_template` is the
directory's Jinja chat template (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`), or None.
"""

import json
import os
from typing import Dict, List, Optional

from megatron.core.tokenizers.base_tokenizer import UNDEFINED_TOKEN_ID
from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_imports import import_optional

_CONVENTIONAL_NAMES = {
    "eos_token": ["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>"],
    "bos_token": ["<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"],
    "pad_token": ["<pad>", "<|pad|>", "[PAD]"],
}


def _tokenizer_json_path(path) -> str:
    if path is None:
        raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local tokenizer directory or tokenizer.json)")
    path = str(path)
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise FileNotFoundError(
                f"--tokenizer-model {path}: no tokenizer.json in this directory; save the tokenizer with "
                f"transformers' AutoTokenizer.from_pretrained(...).save_pretrained({path!r}) to create one"
            )
        return candidate
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(
        f"--tokenizer-model {path}: no such file or directory (only local tokenizers are loaded, nothing is downloaded)"
    )


def _configured_special_tokens(directory: str) -> Dict[str, str]:
    """eos/bos/pad token strings from tokenizer_config.json, then special_tokens_map.json."""
    found: Dict[str, str] = {}
    for file_name in ("tokenizer_config.json", "special_tokens_map.json"):
        config_path = os.path.join(directory, file_name)
        if not os.path.isfile(config_path):
            continue
        try:
            with open(config_path, encoding="utf-8") as file:
                config = json.load(file)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{config_path}: not valid JSON ({error})") from None
        for key in _CONVENTIONAL_NAMES:
            value = config.get(key)
            if isinstance(value, dict):  # transformers' AddedToken form
                value = value.get("content")
            if isinstance(value, str) and key not in found:
                found[key] = value
    return found


def _chat_template(directory: str) -> Optional[str]:
    """The chat template saved with the tokenizer: `chat_template.jinja`, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates of which "default" is the one used)."""
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as file:
            return file.read()
    config_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as file:
        template = json.load(file).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HuggingFaceTokenizer(DictVocabTokenizer):
    """A Hugging Face fast tokenizer, run by the `tokenizers` library.

    `tokenize` applies the tokenizer's post-processor (e.g. Llama's BOS), as `transformers`' `tokenizer(text)`
    does; `detokenize` keeps special tokens in the text.
    """

    def __init__(self, pretrained_model_name_or_path, **kwargs):
        json_path = _tokenizer_json_path(pretrained_model_name_or_path)
        super().__init__(pretrained_model_name_or_path, **kwargs)
        tokenizers = import_optional("tokenizers", "tokenizers", "HuggingFaceTokenizer")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(json_path)
        except Exception as error:  # the Rust loader reports bad files as plain Exceptions
            raise ValueError(f"--tokenizer-model {json_path}: not a Hugging Face tokenizer.json ({error})") from None
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        directory = os.path.dirname(os.path.abspath(json_path))
        configured = _configured_special_tokens(directory)
        self._special_ids = {key: self._special_id(key, configured.get(key)) for key in _CONVENTIONAL_NAMES}
        self.chat_template = _chat_template(directory)

    def _special_id(self, key: str, configured: Optional[str]) -> int:
        if configured is not None:
            token_id = self._tokenizer.token_to_id(configured)
            return UNDEFINED_TOKEN_ID if token_id is None else token_id
        special = {token.content for token in self._tokenizer.get_added_tokens_decoder().values() if token.special}
        for name in _CONVENTIONAL_NAMES[key]:
            if name in special:
                return self._tokenizer.token_to_id(name)
        return UNDEFINED_TOKEN_ID

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def detokenize(self, ids: List[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._special_ids["eos_token"]

    @property
    def eos(self) -> int:
        return self._special_ids["eos_token"]

    @property
    def bos(self) -> int:
        return self._special_ids["bos_token"]

    @property
    def pad(self) -> int:
        return self._special_ids["pad_token"]
