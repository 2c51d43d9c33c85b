"""``build_tokenizer``: Megatron's ``--tokenizer-type`` names -> a ``Tokenizer``, from local files or objects in a
store (``s3://``); never from the hub."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from megatron_lite.core.object_staging import local_input, object_cache_dir, url_digest
from megatron_lite.core.object_store import is_remote, upload
from megatron_lite.tokenizers.base import Tokenizer, require_file
from megatron_lite.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron_lite.tokenizers.huggingface import CONFIG_FILES as HF_CONFIG_FILES
from megatron_lite.tokenizers.huggingface import HuggingFaceTokenizer, looks_like_hub_id, no_download_error
from megatron_lite.tokenizers.null_tokenizer import NullTokenizer
from megatron_lite.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from megatron_lite.tokenizers.tiktoken_tokenizer import TikTokenizer
from megatron_lite.utils.jsonl import iter_jsonl_texts
from megatron_lite.utils.local_path import require_local_or_object_path

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
"""The canonical type names (Megatron's ``--tokenizer-type`` values)."""

# lower-cased, without "-"/"_"; GPTSentencePieceTokenizer is Megatron's name for what our SentencePiece does
_ALIASES = {
    "sentencepiecetokenizer": "SentencePieceTokenizer",
    "sentencepiece": "SentencePieceTokenizer",
    "spm": "SentencePieceTokenizer",
    "gptsentencepiecetokenizer": "SentencePieceTokenizer",
    "gpt2bpetokenizer": "GPT2BPETokenizer",
    "gpt2bpe": "GPT2BPETokenizer",
    "gpt2": "GPT2BPETokenizer",
    "huggingfacetokenizer": "HuggingFaceTokenizer",
    "huggingface": "HuggingFaceTokenizer",
    "hf": "HuggingFaceTokenizer",
    "tiktokenizer": "TikTokenizer",
    "tiktoken": "TikTokenizer",
    "nulltokenizer": "NullTokenizer",
    "null": "NullTokenizer",
}


def canonical_tokenizer_type(tokenizer_type: str) -> str:
    """The canonical name for ``tokenizer_type`` (case and ``-``/``_`` ignored); ValueError listing the valid ones."""
    key = str(tokenizer_type).lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise ValueError(
            f"unknown tokenizer_type {tokenizer_type!r}; use one of {', '.join(TOKENIZER_TYPES)} "
            f"(or the aliases sentencepiece, gpt2, hf, tiktoken, null)"
        )
    return _ALIASES[key]


def _local_file(path: str | os.PathLike[str], what: str, fix: str) -> str:
    """``path`` if it is a local file; a hub-id-shaped string gets the never-download error."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path) and looks_like_hub_id(path):
        raise no_download_error(path)
    return require_file(path, what, fix)


def _train(
    train_corpus: str | os.PathLike[str],
    json_key: str,
    vocab_size: int | None,
    output_prefix: str | os.PathLike[str] | None,
) -> str:
    """Train a SentencePiece model on a JSONL corpus; returns the ``.model`` path."""
    if vocab_size is None or output_prefix is None:
        raise ValueError(
            "SentencePieceTokenizer training (train_corpus given, no tokenizer_model) needs vocab_size "
            "and output_prefix (where <output_prefix>.model is written)"
        )
    # an object is streamed (open_bytes): a corpus need not fit on the local disk
    corpus = (
        os.fspath(train_corpus)
        if is_remote(train_corpus)
        else _local_file(train_corpus, "train_corpus", "pass a .jsonl or .jsonl.gz file")
    )
    errors: list[Exception] = []

    def texts() -> Iterator[str]:
        """Remember a corpus error: SentencePiece would bury it inside its own RuntimeError text."""
        try:
            yield from iter_jsonl_texts(corpus, json_key, what="train_corpus")
        except Exception as err:
            errors.append(err)
            raise

    try:
        if not is_remote(output_prefix):
            return train_sentencepiece(texts(), os.fspath(output_prefix), vocab_size)
        # SentencePiece writes files: train into the local cache, then upload the pair (the .model last, so a pair
        # cut short has no model), and load the local copy
        url = os.fspath(output_prefix)
        local = os.path.join(object_cache_dir(), f"trained-{url_digest(url)}", url.rstrip("/").rsplit("/", 1)[-1])
        model = train_sentencepiece(texts(), local, vocab_size)
        for suffix in (".vocab", ".model"):
            if os.path.isfile(local + suffix):
                upload(local + suffix, url + suffix)
        return model
    except ValueError:
        if errors:
            raise errors[0] from None
        raise


def _read_template(chat_template: str) -> str:
    """A Jinja2 string, or the text of a ``.jinja`` file path."""
    if chat_template.endswith(".jinja") and "\n" not in chat_template:
        with open(
            require_file(chat_template, "chat_template file", "pass a .jinja file or a template string"),
            encoding="utf-8",
        ) as f:
            return f.read()
    return chat_template


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | os.PathLike[str] | None = None,
    vocab_file: str | os.PathLike[str] | None = None,
    merge_file: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    chat_template: str | None = None,
    train_corpus: str | os.PathLike[str] | None = None,
    json_key: str = "text",
    output_prefix: str | os.PathLike[str] | None = None,
    tiktoken_pattern: str = "v2",
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: Sequence[str] | None = None,
) -> Tokenizer:
    """Build a tokenizer by Megatron type name from its files; ``chat_template`` overrides the model's.

    The files (and ``train_corpus``) may be local paths or ``s3://`` URLs: a file in a store (or a directory: every
    object under the prefix) is read from a local copy, downloaded once per ETag
    (:func:`~megatron_lite.core.object_staging.local_input`); a training corpus is streamed.

    - ``SentencePieceTokenizer``: ``tokenizer_model`` (a ``.model``), or ``train_corpus`` (JSONL, text under
      ``json_key``) + ``vocab_size`` + ``output_prefix`` to train one (every call trains; reuse the model after).
    - ``GPT2BPETokenizer``: ``vocab_file`` + ``merge_file``.
    - ``HuggingFaceTokenizer``: ``tokenizer_model`` = a directory with ``tokenizer.json``, or that file.
    - ``TikTokenizer``: ``tokenizer_model`` = a rank file; ``vocab_size`` (optional) truncates as in Megatron.
    - ``NullTokenizer``: ``vocab_size``.

    ``vocab_size`` is ignored by the types whose files fix it (SentencePiece loading, GPT-2, HF). Missing
    arguments raise ValueError naming them, missing files FileNotFoundError naming the file.
    """
    for value, what in (
        (tokenizer_model, "tokenizer_model"),
        (vocab_file, "vocab_file"),
        (merge_file, "merge_file"),
        (train_corpus, "train_corpus"),
    ):
        require_local_or_object_path(value, what)
    require_local_or_object_path(output_prefix, "output_prefix")  # the trained model goes there
    kind = canonical_tokenizer_type(tokenizer_type)
    tokenizer_model, vocab_file, merge_file = (
        None if value is None else local_input(value) for value in (tokenizer_model, vocab_file, merge_file)
    )
    tokenizer: Tokenizer
    if kind == "SentencePieceTokenizer":
        if tokenizer_model is not None and train_corpus is not None:
            raise ValueError("SentencePieceTokenizer takes tokenizer_model (load) or train_corpus (train), not both")
        if tokenizer_model is not None:
            tokenizer = SentencePieceTokenizer(
                _local_file(
                    tokenizer_model, "SentencePiece tokenizer_model", "pass the path of a SentencePiece .model file"
                )
            )
        elif train_corpus is not None:
            tokenizer = SentencePieceTokenizer(_train(train_corpus, json_key, vocab_size, output_prefix))
        else:
            raise ValueError(
                "SentencePieceTokenizer needs tokenizer_model (a .model file), or train_corpus + "
                "vocab_size + output_prefix to train one"
            )
    elif kind == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs vocab_file and merge_file (GPT-2's vocab.json and merges.txt)")
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif kind == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(
                "HuggingFaceTokenizer needs tokenizer_model (a local directory with tokenizer.json, "
                "or the tokenizer.json file)"
            )
        tokenizer = HuggingFaceTokenizer(tokenizer_model)
    elif kind == "TikTokenizer":
        if tokenizer_model is None:
            raise ValueError("TikTokenizer needs tokenizer_model (a local tiktoken rank file)")
        tokenizer = TikTokenizer(
            _local_file(tokenizer_model, "tiktoken rank file", "pass the path of a local .tiktoken rank file"),
            pattern=tiktoken_pattern,
            special_tokens=tiktoken_special_tokens,
            num_special_tokens=tiktoken_num_special_tokens,
            vocab_size=vocab_size,
        )
    else:
        if vocab_size is None:
            raise ValueError("NullTokenizer needs vocab_size (ids 0..vocab_size-1; the last is EOD)")
        tokenizer = NullTokenizer(vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = _read_template(chat_template)
    return tokenizer


def tokenizer_spec(tokenizer: object) -> dict | None:
    """The ``build_tokenizer`` keyword arguments that rebuild ``tokenizer`` from its files where they are
    (absolute paths), or None if it is not one of ours. A checkpoint records :func:`portable_tokenizer_spec`
    instead, with copies of the files."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.abspath(tokenizer.model_path)}
    if isinstance(tokenizer, GPT2BPETokenizer):
        return {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": os.path.abspath(tokenizer.vocab_file),
            "merge_file": os.path.abspath(tokenizer.merge_file),
        }
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(tokenizer.path)}
    if isinstance(tokenizer, TikTokenizer):
        return {
            "tokenizer_type": "TikTokenizer",
            "tokenizer_model": os.path.abspath(tokenizer.path),
            "tiktoken_pattern": tokenizer.pattern,
            "tiktoken_num_special_tokens": tokenizer.num_special_tokens,
            "vocab_size": tokenizer.vocab_size,
        }
    if isinstance(tokenizer, NullTokenizer):
        return {"tokenizer_type": "NullTokenizer", "vocab_size": tokenizer.vocab_size}
    return None


FILE_ARGUMENTS = ("tokenizer_model", "vocab_file", "merge_file")
"""The ``build_tokenizer`` arguments that name files."""
TOKENIZER_FOLDER = "tokenizer"
"""The folder inside a checkpoint that holds the copies of its tokenizer's files."""
TOKENIZER_KEY = "megatron_lite_tokenizer"
"""Checkpoint entry naming the data's tokenizer (``build_tokenizer`` arguments), written by GPTModule."""


def portable_tokenizer_spec(tokenizer: object, folder: str = TOKENIZER_FOLDER) -> tuple[dict, dict[str, str]] | None:
    """(``build_tokenizer`` arguments naming the files as ``folder/...``, {``folder/<name>``: the file now}) for
    ``tokenizer``, or None if it is not one of ours: what a checkpoint records with copies of the files (in
    ``folder`` inside it), so that it keeps its tokenizer wherever it goes (:func:`build_recorded_tokenizer`).
    The files get the names transformers reads: ``tokenizer.model``, ``vocab.json``/``merges.txt``,
    ``tokenizer.json`` and the configuration files beside it."""
    spec = tokenizer_spec(tokenizer)
    if spec is None:
        return None
    files: dict[str, str] = {}
    if isinstance(tokenizer, HuggingFaceTokenizer):
        directory = os.path.dirname(os.path.abspath(tokenizer.tokenizer_file))
        files[f"{folder}/tokenizer.json"] = os.path.abspath(tokenizer.tokenizer_file)
        files.update(
            {
                f"{folder}/{name}": os.path.join(directory, name)
                for name in HF_CONFIG_FILES
                if os.path.isfile(os.path.join(directory, name))
            }
        )
        spec["tokenizer_model"] = folder
        return spec, files
    names = {
        "SentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
        "GPT2BPETokenizer": {"vocab_file": "vocab.json", "merge_file": "merges.txt"},
    }.get(spec["tokenizer_type"], {})
    for key in FILE_ARGUMENTS:
        if key in spec:
            inside = f"{folder}/{names.get(key, os.path.basename(spec[key]))}"
            files[inside], spec[key] = spec[key], inside
    return spec, files


def build_recorded_tokenizer(spec: dict, base: str | os.PathLike[str]) -> Tokenizer:
    """``build_tokenizer(**spec)`` for a spec recorded in a checkpoint: its relative file paths (a checkpoint's
    own copies, see :func:`portable_tokenizer_spec`) are taken relative to ``base``, the checkpoint; absolute
    ones (older checkpoints) as they are. FileNotFoundError naming the first file that is not there."""
    spec = dict(spec)
    for key in FILE_ARGUMENTS:
        if key in spec:
            spec[key] = os.path.join(os.fspath(base), os.fspath(spec[key]))
            if not os.path.exists(spec[key]):
                raise FileNotFoundError(
                    f"the checkpoint's tokenizer file {spec[key]} does not exist; pass the "
                    f"tokenizer with --tokenizer-type {spec.get('tokenizer_type')} and its files "
                    f"(--tokenizer-model, or --vocab-file and --merge-file)"
                )
    return build_tokenizer(**spec)
