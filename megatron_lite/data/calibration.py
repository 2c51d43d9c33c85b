"""Calibration (and held-out) batches for post-training: the first windows of a corpus, read only as far as needed.

The verbs ``megatron-lite quantize`` and ``megatron-lite prune`` calibrate on them (their ``--data``,
``--json-key``, ``--calib-batches``, ``--eval-batches``, ``--batch-size`` and ``--seq-length``: the messages
below name those options). The source is a preprocessed indexed dataset (``PREFIX.bin``/``PREFIX.idx``: its
token ids), a JSONL corpus (``.gz`` allowed) or the name of a bundled corpus (its texts tokenized, each followed
by the end-of-document token); the first two may be at ``s3://`` URLs (a corpus object is streamed, only as far as
needed). Batch ``i``'s row ``r`` is window ``i * batch_size + r``: ``seq_length + 1``
tokens starting at that many times ``seq_length`` in the token stream (inputs and shifted labels, as training
windows are cut).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lite.core.object_store import is_file, is_remote
from megatron_lite.data.bundled import resolve_corpus
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.utils.jsonl import iter_jsonl_texts


def corpus_tokens(source: str, tokenizer: Any, needed: int, json_key: str = "text") -> list[int]:
    """At least ``needed`` tokens of ``source`` (documents in order) when it holds them; all of them otherwise."""
    tokens: list[int] = []
    if IndexedDataset.exists(source):
        dataset = IndexedDataset(source)
        for i in range(len(dataset)):
            tokens.extend(int(t) for t in dataset[i])
            if len(tokens) >= needed:
                break
        return tokens
    try:
        path = _corpus_object(source) if is_remote(source) else resolve_corpus(source)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"--data {source}: not an indexed dataset prefix (PREFIX.bin/.idx) either; {err}"
        ) from None
    eod: Optional[int] = getattr(tokenizer, "eod", None)
    for text in iter_jsonl_texts(path, json_key, what="--data", option="--json-key"):
        tokens.extend(tokenizer.tokenize(text))
        if eod is not None:
            tokens.append(eod)
        if len(tokens) >= needed:
            break
    return tokens


def _corpus_object(url: str) -> str:
    """``url`` if it names an object (a JSONL corpus, streamed as it is read); FileNotFoundError otherwise."""
    if not is_file(url):
        raise FileNotFoundError(f"no object {url} in the store; pass the URL of a .jsonl or .jsonl.gz object")
    return url


def calibration_batches(
    source: str,
    tokenizer: Any,
    seq_length: int,
    batch_size: int,
    count: int,
    json_key: str = "text",
    vocab_size: Optional[int] = None,
) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` batches ``{"tokens": LongTensor[batch_size, seq_length + 1]}`` of ``source``'s windows.
    ValueError naming the fix when it holds no text, too few tokens, or (given ``vocab_size``) a token id outside
    the model's vocabulary."""
    windows = count * batch_size
    tokens = corpus_tokens(source, tokenizer, windows * seq_length + 1, json_key)
    if not tokens:
        raise ValueError(
            f"--data {source} holds no text (no non-empty {json_key!r} field); pass a JSONL corpus with "
            f"text, or --json-key naming the field that holds it"
        )
    found = max(0, (len(tokens) - 1) // seq_length)
    if found < windows:
        raise ValueError(
            f"--data {source} holds {len(tokens)} tokens: {found} windows of {seq_length} + 1 tokens, "
            f"fewer than the {windows} that --calib-batches + --eval-batches batches of "
            f"--batch-size {batch_size} need; give more text, or lower --calib-batches, "
            f"--eval-batches, --batch-size or --seq-length"
        )
    flat = torch.tensor(tokens[: windows * seq_length + 1], dtype=torch.int64)
    if vocab_size is not None and int(flat.max()) >= vocab_size:
        raise ValueError(
            f"--data holds token id {int(flat.max())}, outside the model's vocabulary ({vocab_size}); "
            f"tokenize it with the model's tokenizer"
        )
    rows = [flat[i * seq_length : i * seq_length + seq_length + 1] for i in range(windows)]
    return [{"tokens": torch.stack(rows[i : i + batch_size])} for i in range(0, windows, batch_size)]
