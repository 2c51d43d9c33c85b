"""Models at object-store URLs (``s3://bucket/key``) for the readers that need local files.

A URL names one of our checkpoints (its commit marker, or a directory of checkpoints: the latest one) or a Hugging
Face directory (``config.json`` under the prefix; an export uploads it last, so a cut-short one has none). Our
checkpoints' tensors are read where they are (DCP's fsspec reader), so :func:`local_files` copies only their small
files -- ``meta.json``, ``.metadata``, the manifest, the tokenizer and HF files they carry; a Hugging Face directory
is copied whole, since its readers (safetensors, tokenizers) need files. Copies are cached by content
(:mod:`megatron_lite.core.object_staging`).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_lite.core.checkpoint.format.sharded import resolve_checkpoint
from megatron_lite.core.checkpoint.hf.directory import CONFIG
from megatron_lite.core.object_staging import cached_directory, local_input
from megatron_lite.core.object_store import is_file, is_remote, join, location

TENSOR_SHARDS = ".distcp"
"""The name ending of a checkpoint's tensor files, which :func:`local_files` leaves in the store."""


def is_hf_url(url: str) -> bool:
    """Whether the prefix ``url`` holds a Hugging Face model directory (its ``config.json``)."""
    return is_file(join(url, CONFIG))


def resolve_remote_checkpoint(url: str) -> str:
    """The prefix of the files of our checkpoint at ``url`` (see
    :func:`~megatron_lite.core.checkpoint.format.sharded.resolve_checkpoint`); ``FileNotFoundError`` saying that it
    is neither one nor a Hugging Face directory otherwise."""
    try:
        return str(resolve_checkpoint(url))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{url} is neither a Hugging Face model directory (no {CONFIG} under it: nothing was exported there, or "
            f"an export was cut short before its {CONFIG}, which is uploaded last) nor a megatron-lite checkpoint "
            f"({error})"
        ) from None


def local_directory(path: str | os.PathLike[str], marker: str, what: str) -> Path:
    """``path`` itself for a local path; for a URL, a local copy of the directory there (every object under it),
    refused with ``FileNotFoundError`` naming the URL unless it holds ``marker`` -- the file a writer uploads last
    (an HF directory's ``config.json``, a PEFT adapter's ``adapter_config.json``). ``what`` names the directory."""
    if not is_remote(path):
        return Path(path)
    url = str(location(path))
    if not is_file(join(url, marker)):
        raise FileNotFoundError(
            f"{url} is not {what} (no {marker} under it: nothing was written there, or an upload was cut short "
            f"before its {marker}, which is uploaded last); pass the URL the export wrote"
        )
    return Path(local_input(url))


def local_files(path: str | os.PathLike[str]) -> Path:
    """``path`` itself for a local path; for a URL, a local copy of the Hugging Face directory there, or of the
    files of our checkpoint there other than its tensor shards (what tokenizer, HF-file and fingerprint readers
    need). ``FileNotFoundError`` naming the URL when it is neither."""
    if not is_remote(path):
        return Path(path)
    url = str(location(path))
    if is_hf_url(url):
        return local_directory(url, CONFIG, "a Hugging Face model directory")
    return Path(cached_directory(resolve_remote_checkpoint(url), exclude=(TENSOR_SHARDS,)))
