"""Any local Hugging Face fast tokenizer (``tokenizer.json``), read with the ``tokenizers`` library only.

No ``transformers`` and no hub: a path that does not exist is an error, never a download.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from megatron_lite.tokenizers._hf_backed import HFBackedTokenizer
from megatron_lite.utils.optional import require

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""The special-token entries read from ``tokenizer_config.json`` / ``special_tokens_map.json``."""
CONFIG_FILES = ("special_tokens_map.json", "tokenizer_config.json", "chat_template.jinja")
"""The files beside ``tokenizer.json`` that :class:`HuggingFaceTokenizer` reads (special tokens, chat template)."""

# "gpt2", "meta-llama/Llama-3.1-8B": one or two name parts, and no file suffix a local path would have
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_FILE_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")


def looks_like_hub_id(path: str) -> bool:
    """True for strings shaped like a hub repository id (and not like a local file or relative path)."""
    return bool(_HUB_ID.fullmatch(path)) and not path.endswith(_FILE_SUFFIXES)


def no_download_error(path: str) -> FileNotFoundError:
    """The error for a hub id given where a local path is needed."""
    return FileNotFoundError(
        f"{path!r} is not a local path; megatron-lite never downloads tokenizers — download it once "
        f"(e.g. `huggingface-cli download {path} --local-dir DIR`) and pass the directory"
    )


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``; ValueError naming the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); fix or delete the file") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}; fix or delete the file")
    return data


def _token_text(value: Any, source: str, key: str) -> str | None:
    """A special token entry: a string, ``{"content": ...}`` (AddedToken), or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f'{source}: {key} must be a string or {{"content": ...}}, got {value!r}; fix the file')


def _pick_template(value: Any, source: str) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` of which HF uses "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    raise ValueError(f"{source}: chat_template must be a string or a list of named templates; fix the file")


class HuggingFaceTokenizer(HFBackedTokenizer):
    """A ``tokenizer.json`` (file, or a directory holding it) plus the special tokens and chat template
    from ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``chat_template.jinja`` beside it.

    As in ``transformers``, added special tokens written in the text (e.g. ``<|im_start|>``) encode to
    their ids; nothing (BOS/EOS) is added around the text.
    """

    def __init__(self, path: str | os.PathLike[str], *, special_tokens: Mapping[str, str] | None = None) -> None:
        """Load ``path``; ``special_tokens`` (e.g. ``{"eos_token": "</s>"}``) overrides the config files."""
        hf = require("tokenizers", "HuggingFaceTokenizer")  # the data extra, not the base install
        path = os.path.expanduser(os.fspath(path))
        if not os.path.exists(path):
            if looks_like_hub_id(path):
                raise no_download_error(path)
            raise FileNotFoundError(
                f"HuggingFace tokenizer path {path} does not exist; pass a local directory "
                f"containing tokenizer.json, or the tokenizer.json file itself"
            )
        if os.path.isdir(path):
            directory, tokenizer_file = path, os.path.join(path, "tokenizer.json")
            if not os.path.isfile(tokenizer_file):
                hint = (
                    " (it has a SentencePiece tokenizer.model: use SentencePieceTokenizer)"
                    if os.path.isfile(os.path.join(path, "tokenizer.model"))
                    else ""
                )
                raise FileNotFoundError(
                    f"{tokenizer_file} does not exist{hint}; megatron-lite reads fast tokenizers only: save one "
                    f"with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(dir)` or "
                    f"tokenizers' `Tokenizer.save(dir + '/tokenizer.json')`"
                )
        else:
            directory, tokenizer_file = os.path.dirname(os.path.abspath(path)), path
        self.path = path
        """The path given (directory or file)."""
        self.tokenizer_file = tokenizer_file
        """The ``tokenizer.json`` that was loaded."""
        try:
            self._tok = hf.Tokenizer.from_file(tokenizer_file)
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(
                f"{tokenizer_file} is not a Hugging Face tokenizers file ({err}); pass a "
                f"tokenizer.json written by tokenizers/transformers"
            ) from err

        tokens, self._template = self._read_config(directory)
        for key, value in (special_tokens or {}).items():
            if key not in SPECIAL_TOKEN_KEYS:
                raise ValueError(f"special_tokens key {key!r} is not one of {SPECIAL_TOKEN_KEYS}")
            tokens[key] = value
        self._special: dict[str, tuple[str, int] | None] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = tokens.get(key)
            token_id = None if text is None else self._tok.token_to_id(text)
            if text is not None and token_id is None:
                raise ValueError(
                    f"{key} {text!r} (from {directory}) is not in the vocabulary of {tokenizer_file}; "
                    f"fix {key} in tokenizer_config.json or pass special_tokens={{{key!r}: ...}}"
                )
            self._special[key] = None if text is None else (text, int(token_id))
        # ids may have holes (added tokens appended past the base vocabulary): size by the largest id
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @staticmethod
    def _read_config(directory: str) -> tuple[dict[str, str | None], str | None]:
        """Special tokens and chat template from the files transformers writes beside tokenizer.json."""
        tokens: dict[str, str | None] = {}
        template = None
        # special_tokens_map.json is the older home of the special tokens; tokenizer_config.json wins
        for name in CONFIG_FILES[:2]:
            source = os.path.join(directory, name)
            if not os.path.isfile(source):
                continue
            config = _read_json(source)
            for key in SPECIAL_TOKEN_KEYS:
                if key in config:
                    tokens[key] = _token_text(config[key], source, key)
            if "chat_template" in config:
                template = _pick_template(config["chat_template"], source)
        # transformers >= 4.43 saves the template as its own file, which takes precedence
        jinja = os.path.join(directory, CONFIG_FILES[2])
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        return tokens, template

    @property
    def vocab_size(self) -> int:
        """One past the largest id, added tokens included."""
        return self._vocab_size

    def _id(self, key: str) -> int | None:
        """Id of a special token, or None."""
        entry = self._special[key]
        return None if entry is None else entry[1]

    def _text(self, key: str) -> str | None:
        """Text of a special token, or None."""
        entry = self._special[key]
        return None if entry is None else entry[0]

    @property
    def eod(self) -> int:
        """The EOS id; ValueError if the tokenizer names no EOS token."""
        eos = self.eos
        if eos is None:
            raise ValueError(
                f"HF tokenizer {self.path} names no eos_token to mark document ends; set eos_token in "
                f"tokenizer_config.json or pass special_tokens={{'eos_token': ...}}"
            )
        return eos

    @property
    def bos(self) -> int | None:
        """BOS id, or None."""
        return self._id("bos_token")

    @property
    def eos(self) -> int | None:
        """EOS id, or None."""
        return self._id("eos_token")

    @property
    def pad(self) -> int | None:
        """PAD id, or None."""
        return self._id("pad_token")

    @property
    def unk(self) -> int | None:
        """UNK id, or None."""
        return self._id("unk_token")

    @property
    def bos_token(self) -> str | None:
        """BOS text, or None."""
        return self._text("bos_token")

    @property
    def eos_token(self) -> str | None:
        """EOS text, or None."""
        return self._text("eos_token")

    def _native_chat_template(self) -> str | None:
        """The template from ``chat_template.jinja`` or ``tokenizer_config.json``."""
        return self._template
