"""Tokenize a corpus into Megatron-LM ``.bin``/``.idx`` pairs (``tools/preprocess_data.py``), and merge pairs.

    megatron-lite preprocess --input corpus.jsonl.gz --json-keys text --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --output-prefix out/corpus --workers 4 --append-eod
    megatron-lite preprocess merge --input out/a_text_document out/b_text_document \\
        --output-prefix out/ab_text_document

Inputs (``--input``, files or globs): JSON lines (``.jsonl``/``.json``/``.ndjson``, gzipped or not), a JSON
array file, ``.parquet``, or a Hugging Face ``datasets`` directory written by ``save_to_disk``; local paths or
``s3://`` URLs (streamed, see :mod:`megatron_lite.data.corpus_readers`); nothing is ever fetched from the hub.
Each key of ``--json-keys`` gives ``{output_prefix}_{key}_document.bin/.idx`` (``_sentence`` with
``--split-sentences``). The main process reads the input and writes the output; worker
processes tokenize chunks of documents, and results are written in input order, so any ``--workers`` gives
byte-identical files. Documents that tokenize to nothing are skipped and counted. Output goes to temporary
names and is renamed at the end, so a failed run never leaves a half-written pair. The command line is
:mod:`megatron_lite.cli.preprocess`.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from megatron_lite.core.object_store import check_bucket, is_remote, upload

# PreprocessError and resolve_inputs are part of this module's interface; they live with the input readers
from megatron_lite.data.corpus_readers import (
    PreprocessError,
    chunk_items,
    input_kind,
    is_dir,
    object_matches,
    read_items,
    resolve_inputs,
)
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, merge_datasets, optimal_dtype
from megatron_lite.utils.jsonl import parse_object_line, require_object
from megatron_lite.utils.local_path import require_local_or_object_path
from megatron_lite.utils.optional import require


@dataclass
class PreprocessResult:
    """What one run wrote: per JSON key, the output prefix and its counts."""

    output_prefixes: dict[str, str]
    """``{key: prefix}`` of each written ``.bin``/``.idx`` pair."""
    documents: dict[str, int]
    """Documents written per key."""
    empty_documents: dict[str, int]
    """Documents skipped per key because they had no tokens."""
    tokens: dict[str, int]
    """Tokens written per key (EOD included)."""
    seconds: float = 0.0
    """Wall time from the first chunk read to the files renamed."""
    inputs: list[str] = field(default_factory=list)
    """The input files read, in order."""

    @property
    def tokens_per_second(self) -> float:
        """All keys' tokens over the wall time."""
        return sum(self.tokens.values()) / max(self.seconds, 1e-9)


_SENTENCE_END = re.compile(r"[.!?]+[\"')\]\u201d\u2019]*(?=\s|$)|\n[ \t]*\n")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after ``.``/``!``/``?`` (and closing quotes) before whitespace, and at blank
    lines; stripped, empty ones dropped. A plain regex (no nltk download), so "Mr. Smith" is cut too."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        piece = text[start : match.end()].strip()
        if piece:
            sentences.append(piece)
        start = match.end()
    tail = text[start:].strip()
    return sentences + [tail] if tail else sentences


# --- tokenizing (worker processes) ---------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]) -> None:
    """Pool initializer: keep the tokenizer and options; one tokenizing thread per worker process."""
    # N workers already use N cores; tokenizers' own thread pool on top would oversubscribe them
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.clear()
    _WORKER.update(state)


def _texts(item: Any, where: str, keys: Sequence[str]) -> Optional[dict[str, list[str]]]:
    """``{key: pieces}`` of one record (pieces: the text, or a list of pre-split sentences); None for a blank line."""
    if isinstance(item, str):  # a raw JSON line
        item = parse_object_line(item, where, keys[0], what="the input", error=PreprocessError)
        if item is None:
            return None
    else:  # a row of a JSON array, parquet file or saved dataset
        item = require_object(item, where, keys[0], error=PreprocessError)
    out = {}
    for key in keys:
        if key not in item:
            raise PreprocessError(
                f"{where} has no key {key!r} (keys: {sorted(item)}); pass --json-keys with the key that holds the text"
            )
        value = item[key]
        if value is None:
            value = []
        elif isinstance(value, str):
            value = [value]
        elif not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise PreprocessError(f"{where}: {key!r} is a {type(value).__name__}, not a string (or list of strings)")
        out[key] = value
    return out


def _encode_chunk(chunk: tuple[str, str, int, list]) -> tuple[int, dict[str, tuple[np.ndarray, ...]]]:
    """Tokenize one chunk: ``(records, {key: (tokens, sequence lengths, sequences per document, empty count)})``."""
    path, kind, first, items = chunk
    keys, tok, vocab_size = _WORKER["keys"], _WORKER["tokenizer"], _WORKER["vocab_size"]

    def where(j: int) -> str:
        return f"{path}:{first + j}" if kind == "line" else f"{path} record {first + j}"

    records = [(j, t) for j, t in ((j, _texts(item, where(j), keys)) for j, item in enumerate(items)) if t is not None]
    out: dict[str, tuple[np.ndarray, ...]] = {}
    for key in keys:
        texts: list[str] = []
        owners: list[int] = []  # record of each text, for error messages
        counts: list[int] = []  # texts per record
        for j, record in records:
            pieces = [s for p in record[key] for s in (split_sentences(p) if _WORKER["split_sentences"] else [p])]
            texts.extend(pieces)
            owners.extend([j] * len(pieces))
            counts.append(len(pieces))
        try:
            batch = tok.tokenize_batch(texts) if hasattr(tok, "tokenize_batch") else [tok.tokenize(t) for t in texts]
        except Exception:  # find the text at fault, one by one, to name its line
            for j, text in zip(owners, texts):
                try:
                    tok.tokenize(text)
                except Exception as err:
                    raise PreprocessError(f"{where(j)}: {type(tok).__name__} cannot tokenize {key!r} ({err})") from None
            raise
        tokens: list[int] = []
        lengths: list[int] = []
        per_doc: list[int] = []
        doc_starts: list[tuple[int, int]] = []  # (first token, record) of each written document, for errors
        empty = pos = 0
        for (j, _), n in zip(records, counts):
            doc = [ids for ids in batch[pos : pos + n] if len(ids) > 0]  # Megatron drops empty sentences
            pos += n
            if not doc:
                empty += 1
                continue
            doc_starts.append((len(tokens), j))
            for ids in doc:
                tokens.extend(ids)
                lengths.append(len(ids))
            if _WORKER["append_eod"]:
                tokens.append(_WORKER["eod"])
                lengths[-1] += 1
            per_doc.append(len(doc))
        ids_array = np.asarray(tokens, dtype=np.int64)
        if ids_array.size and (int(ids_array.max()) >= vocab_size or int(ids_array.min()) < 0):
            bad_at = int(np.flatnonzero((ids_array >= vocab_size) | (ids_array < 0))[0])
            j = next(rec for start, rec in reversed(doc_starts) if start <= bad_at)
            raise PreprocessError(
                f"{where(j)}: {type(tok).__name__} produced token id {int(ids_array[bad_at])}, outside its vocabulary "
                f"of {vocab_size}: the tokenizer files do not match each other (e.g. --vocab-size too small, or a "
                f"vocab file of another model); fix --tokenizer-model/--vocab-file/--vocab-size"
            )
        out[key] = (
            ids_array.astype(_WORKER["dtype"]),
            np.asarray(lengths, dtype=np.int64),
            np.asarray(per_doc, dtype=np.int64),
            np.int64(empty),
        )
    return len(records), out


# --- the run (main process) ----------------------------------------------------------------------------


def _check_output(output_prefix: str) -> None:
    """The output directory exists (created if needed) and is writable, else PreprocessError naming it."""
    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise PreprocessError(
            f"--output-prefix {output_prefix} is a directory; give a file prefix such as "
            f"{os.path.join(output_prefix, 'corpus')}"
        )
    parent = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise PreprocessError(
            f"cannot create output directory {parent} ({err.strerror}); choose another --output-prefix"
        ) from None
    if not os.access(parent, os.W_OK):
        raise PreprocessError(f"output directory {parent} is not writable; choose another --output-prefix")


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: Any,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    append_eod: bool = False,
    split_sentences: bool = False,
    chunk_size: int = 256,
    log_interval: int = 1000,
    progress: Optional[bool] = None,
    hf_split: str = "train",
) -> PreprocessResult:
    """Tokenize ``inputs`` into one ``.bin``/``.idx`` pair per JSON key; ``progress`` None = a bar on a tty."""
    if workers < 1 or chunk_size < 1 or log_interval < 1:
        raise PreprocessError(
            f"--workers ({workers}), --chunk-size ({chunk_size}) and --log-interval ({log_interval}) must be >= 1"
        )
    for pattern in inputs:
        require_local_or_object_path(pattern, "--input")
    require_local_or_object_path(output_prefix, "--output-prefix")
    paths = resolve_inputs(inputs)
    for path in paths:
        input_kind(path)  # fail on an unsupported file before any work
    remote = is_remote(output_prefix)
    if remote:
        check_bucket(output_prefix)  # a missing bucket or refused credentials before any work
    else:
        _check_output(output_prefix)
    vocab_size = int(tokenizer.vocab_size)
    eod = int(tokenizer.eod) if append_eod else -1
    if append_eod and not 0 <= eod < vocab_size:
        raise PreprocessError(f"{type(tokenizer).__name__}'s eod id {eod} is outside its vocabulary of {vocab_size}")
    dtype = optimal_dtype(vocab_size)
    level = "sentence" if split_sentences else "document"
    finals = {k: f"{output_prefix}_{k}_{level}" for k in json_keys}
    # an object store's pair is written locally first, then uploaded
    staging = tempfile.mkdtemp(prefix="megatron-lite-preprocess-") if remote else None
    temps = {
        k: os.path.join(staging, f"{k}_{level}") if staging else f"{p}.tmp{os.getpid()}" for k, p in finals.items()
    }
    state = {
        "tokenizer": tokenizer,
        "keys": list(json_keys),
        "append_eod": append_eod,
        "eod": eod,
        "split_sentences": split_sentences,
        "vocab_size": vocab_size,
        "dtype": dtype,
    }
    builders: dict[str, IndexedDatasetBuilder] = {}
    result = PreprocessResult(
        dict(finals),
        dict.fromkeys(json_keys, 0),
        dict.fromkeys(json_keys, 0),
        dict.fromkeys(json_keys, 0),
        inputs=paths,
    )
    start = time.perf_counter()
    try:
        for key in json_keys:
            builders[key] = IndexedDatasetBuilder(temps[key] + ".bin", dtype=dtype)
        _run(paths, json_keys, hf_split, chunk_size, workers, state, builders, result, log_interval, progress, start)
        total = sum(result.documents.values()) + sum(result.empty_documents.values())
        if total == 0:
            raise PreprocessError(f"no documents found in {', '.join(paths)}; the input is empty")
        for key in json_keys:
            if result.documents[key] == 0:
                raise PreprocessError(
                    f"all {result.empty_documents[key]} documents under {key!r} in "
                    f"{', '.join(paths)} are empty; check --json-keys and the input"
                )
            builders[key].finalize(temps[key] + ".idx")
        # .bin first: a crash between the renames (uploads) leaves a pair that fails the size check, never a wrong
        # sample
        for key in json_keys:
            if remote:
                _upload_pair(temps[key], finals[key])
            else:
                for suffix in (".bin", ".idx"):
                    os.replace(temps[key] + suffix, finals[key] + suffix)
    except BaseException:
        for key, builder in builders.items():
            builder.abort()
            if os.path.exists(temps[key] + ".idx"):
                os.remove(temps[key] + ".idx")
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    result.seconds = time.perf_counter() - start
    return result


def _run(
    paths: list[str],
    keys: Sequence[str],
    hf_split: str,
    chunk_size: int,
    workers: int,
    state: dict[str, Any],
    builders: dict[str, IndexedDatasetBuilder],
    result: PreprocessResult,
    log_interval: int,
    progress: Optional[bool],
    start: float,
) -> None:
    """Read, tokenize in ``workers`` processes, and write in input order, with a progress bar or log lines."""
    sources = [(p, *read_items(p, keys, hf_split)) for p in paths]
    known = [n for _, _, _, n in sources]
    total = sum(known) if all(n is not None for n in known) else None  # type: ignore[misc]
    chunks = (c for path, kind, items, _ in sources for c in chunk_items(path, kind, items, chunk_size))
    bar = None
    if progress or (progress is None and sys.stderr.isatty()):
        tqdm = require("tqdm", "the preprocess progress bar (or pass --no-progress)").tqdm
        bar = tqdm(total=total, unit="doc", desc="preprocess", dynamic_ncols=True, file=sys.stderr)
    records, next_log = 0, log_interval
    # fork: workers inherit the tokenizer instead of re-importing the package (seconds per worker otherwise)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(state,)) as pool:
        pending: deque = deque()

        def consume() -> None:
            nonlocal records, next_log
            n, out = pending.popleft().get()
            for key, (tokens, lengths, per_doc, empty) in out.items():
                builders[key].add_documents(tokens, lengths, per_doc)
                result.documents[key] += len(per_doc)
                result.empty_documents[key] += int(empty)
                result.tokens[key] += len(tokens)
            records += n
            rate = sum(result.tokens.values()) / max(time.perf_counter() - start, 1e-9)
            if bar is not None:
                bar.update(n)
                bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
            elif records >= next_log:
                print(
                    f"preprocess: {records:,} documents, {sum(result.tokens.values()):,} tokens ({rate:,.0f} tokens/s)",
                    file=sys.stderr,
                    flush=True,
                )
                next_log = (records // log_interval + 1) * log_interval

        try:
            # a bounded window of chunks in flight: ordered results, memory independent of the corpus size
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(pending) >= 4 * workers:
                    consume()
            while pending:
                consume()
        finally:
            if bar is not None:
                bar.close()
        pool.close()
        pool.join()


def _upload_pair(local_prefix: str, url_prefix: str) -> None:
    """Upload a written pair, the ``.bin`` first: a run cut short in between leaves a pair that fails the size check,
    never a wrong sample."""
    for suffix in (".bin", ".idx"):
        upload(local_prefix + suffix, url_prefix + suffix)


def _matches(pattern: str) -> list[str]:
    """The paths (or URLs) ``pattern`` matches when it has wildcards, else ``[pattern]``."""
    if is_remote(pattern):
        return object_matches(pattern) if glob.has_magic(pattern) else [pattern]
    return sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]


def merge(inputs: Sequence[str], output_prefix: str) -> list[str]:
    """Concatenate the ``.bin``/``.idx`` pairs ``inputs`` name, in order, into ``output_prefix``: prefixes (path
    without ``.bin``/``.idx``), ``.idx``/``.bin`` files or globs of them, or directories (all their pairs, sorted by
    name); local paths or ``s3://`` URLs (inputs are streamed; an output at a URL is written locally, then
    uploaded). Returns the prefixes merged; PreprocessError naming the input that matches nothing."""
    for pattern in inputs:
        require_local_or_object_path(pattern, "--input")
    require_local_or_object_path(output_prefix, "--output-prefix")
    prefixes: list[str] = []
    for pattern in inputs:
        if is_dir(pattern):
            found = _matches(glob.escape(pattern.rstrip("/")) + "/*.idx")
            if not found:
                raise PreprocessError(f"--input {pattern} is a directory with no .idx files")
        else:
            found = _matches(pattern)
            if not found:
                raise PreprocessError(f"--input {pattern} matches no file")
        for path in found:
            prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
            if prefix not in prefixes:
                prefixes.append(prefix)
    if not is_remote(output_prefix):
        _check_output(output_prefix)
        merge_datasets(prefixes, output_prefix)
        return prefixes
    if output_prefix in prefixes:
        raise PreprocessError(f"merge output {output_prefix} is also an input; choose another --output-prefix")
    check_bucket(output_prefix)  # a missing bucket or refused credentials before any work
    staging = tempfile.mkdtemp(prefix="megatron-lite-merge-")
    try:
        _upload_pair(merge_datasets(prefixes, os.path.join(staging, "merged")), output_prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return prefixes
