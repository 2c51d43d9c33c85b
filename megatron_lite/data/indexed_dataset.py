"""Megatron-LM's indexed dataset: token sequences in a ``.bin`` file, located by a ``.idx`` index.

The byte layout is Megatron-LM's (``megatron/core/datasets/indexed_dataset.py``), so files written here
load in Megatron-LM and the reverse. ``.idx``, little-endian::

    b"MMIDIDX\\x00\\x00"   9 bytes magic
    u64 version            always 1
    u8  dtype code         1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16
    u64 N                  number of sequences
    u64 D                  number of document indices (documents + 1)
    i32[N]                 sequence lengths, in tokens
    i64[N]                 sequence pointers, byte offsets into .bin
    i64[D]                 document indices: [0, end of doc 0, end of doc 1, ..., N]
    i8[N]                  sequence modes (multimodal indexes only)

``.bin`` holds the tokens of every sequence back to back in the index's dtype. Both files are
memory-mapped; reading a sequence, or a slice of one with :meth:`IndexedDataset.get`, touches only its
bytes. A prefix in an object store (``s3://bucket/shk``) is read without copying the ``.bin``: the ``.idx`` is
cached locally, each read of the ``.bin`` is a ranged GET of its bytes (:mod:`~megatron_lite.data.remote_file`).
Opening validates the header and both file sizes, so a truncated or foreign pair fails at once with a message naming
the file, never later with a wrong sample.

One file for the reader and the writer (past the usual ~500 lines, on purpose): they are the two halves of one
byte format and must change together, as in Megatron-LM's own ``indexed_dataset.py``.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO, Optional, Union

import numpy as np
import torch

from megatron_lite.core.object_staging import cached_copy
from megatron_lite.core.object_store import errors_named, filesystem, is_remote, location, open_read
from megatron_lite.data.remote_file import RemoteFile

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_HEADER_SIZE = 34
_REBUILD = "rebuild it with `megatron-lite preprocess`"

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron-LM's dtype codes of the ``.idx`` header."""

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[int]]


def optimal_dtype(vocab_size: Optional[int]) -> type[np.number]:
    """Token dtype for a vocabulary, as Megatron-LM picks it: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype: Any) -> int:
    """The header code of ``dtype``; raises ValueError for a dtype Megatron-LM cannot store."""
    np_dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np_dtype:
            return code
    raise ValueError(
        f"dtype {np_dtype} cannot be stored in a Megatron indexed dataset; "
        f"use one of {[np.dtype(d).name for d in DTYPE_CODES.values()]}"
    )


def get_idx_path(path_prefix: str) -> str:
    """Path of the index file of ``path_prefix``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """Path of the data file of ``path_prefix``."""
    return path_prefix + ".bin"


def _missing_files_error(path_prefix: str) -> FileNotFoundError:
    """The error for a prefix whose .bin and/or .idx is absent, naming exactly which."""
    present = filesystem(path_prefix).isfile if is_remote(path_prefix) else os.path.isfile
    missing = [p for p in (get_bin_path(path_prefix), get_idx_path(path_prefix)) if not present(p)]
    hint = "; create the pair with `megatron-lite preprocess --output-prefix ...`"
    if path_prefix.endswith((".bin", ".idx")):
        hint = f"; pass the prefix without the extension ({path_prefix[:-4]!r}, not {path_prefix!r})"
    elif len(missing) == 1:
        hint = "; the pair is incomplete (an interrupted copy or preprocessing run?), " + _REBUILD
    return FileNotFoundError(f"indexed dataset {path_prefix!r}: missing {' and '.join(missing)}{hint}")


class _Index:
    """The parsed ``.idx`` file: header fields and memory-mapped arrays, validated against the ``.bin``."""

    def __init__(self, idx_path: str, bin_size: Optional[int], multimodal: bool, source: Optional[str] = None) -> None:
        """Read and validate ``idx_path``; ``bin_size`` (bytes of the ``.bin``) is checked when given. ``source``: the
        name errors give the index (the URL whose local copy ``idx_path`` is)."""
        shown = source or idx_path
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_SIZE)
        if header[:9] != _INDEX_HEADER:
            raise ValueError(
                f"{shown} is not a Megatron indexed dataset index (bad magic {header[:9]!r}, "
                f"expected {_INDEX_HEADER!r}); {_REBUILD}"
            )
        if len(header) < _HEADER_SIZE:
            raise ValueError(
                f"{shown} is truncated: {size} bytes, shorter than the {_HEADER_SIZE}-byte header; {_REBUILD}"
            )
        version, code, count, doc_count = struct.unpack("<QBQQ", header[9:])
        if version != _VERSION:
            raise ValueError(
                f"{shown} has index version {version}; only version {_VERSION} (Megatron-LM's) can be read; {_REBUILD}"
            )
        if code not in DTYPE_CODES:
            known = ", ".join(f"{c} {np.dtype(d).name}" for c, d in DTYPE_CODES.items())
            raise ValueError(
                f"{shown} has unknown dtype code {code} (known: {known}); the file is corrupt "
                f"or from another tool; {_REBUILD}"
            )
        self.dtype: type[np.number] = DTYPE_CODES[code]
        self.itemsize = np.dtype(self.dtype).itemsize
        self.sequence_count = count
        self.document_count = doc_count
        expected = _HEADER_SIZE + 12 * count + 8 * doc_count + (count if multimodal else 0)
        if size != expected:
            what = "truncated" if size < expected else f"{size - expected} bytes longer than its header says"
            hint = ""
            if not multimodal and size - expected == count > 0:
                hint = " It looks like a multimodal index: open it with multimodal=True."
            raise ValueError(
                f"{shown} is {what}: its header promises {count} sequences and {doc_count} "
                f"document indices ({expected} bytes) but the file has {size} bytes.{hint} {_REBUILD}"
            )
        if doc_count < 1:
            raise ValueError(f"{shown} has no document indices (Megatron-LM writes at least [0]); {_REBUILD}")

        # numpy cannot map an empty file, and the index is never empty: map it whole, view the arrays
        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buffer = memoryview(self._mmap)
        offset = _HEADER_SIZE
        self.sequence_lengths: np.ndarray = np.frombuffer(buffer, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers: np.ndarray = np.frombuffer(buffer, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self.document_indices: np.ndarray = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=offset)
        offset += 8 * doc_count
        self.sequence_modes: Optional[np.ndarray] = (
            np.frombuffer(buffer, dtype=np.int8, count=count, offset=offset) if multimodal else None
        )

        # cheap consistency checks: O(1) reads, so opening stays instant for any size
        first, last = int(self.document_indices[0]), int(self.document_indices[-1])
        if first != 0 or last != count:
            raise ValueError(
                f"{shown} has inconsistent document indices (first {first}, last {last}; "
                f"expected 0 and the sequence count {count}); {_REBUILD}"
            )
        if bin_size is not None:
            end = 0 if count == 0 else int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.itemsize
            start = 0 if count == 0 else int(self.sequence_pointers[0])
            if start != 0 or end != bin_size:
                bin_path = shown[:-4] + ".bin"
                raise ValueError(
                    f"{bin_path} has {bin_size} bytes but {shown} describes {end} bytes of "
                    f"{np.dtype(self.dtype).name} tokens in {count} sequences (first pointer {start}); "
                    f"the .bin and .idx do not belong together or one of them is truncated; "
                    f"rebuild both with `megatron-lite preprocess`"
                )


class IndexedDataset(torch.utils.data.Dataset):
    """Megatron-LM's ``IndexedDataset``: ``ds[i]`` is sequence ``i`` as a read-only numpy array."""

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        """Open ``path_prefix``.bin/.idx; raises FileNotFoundError/ValueError naming the bad file and the fix."""
        super().__init__()
        self.path_prefix = path_prefix
        """Prefix of the ``.bin``/``.idx`` pair."""
        self.multimodal = multimodal
        """Whether the index carries a mode (int8) per sequence."""
        self.mmap = mmap
        """Memory-map the ``.bin`` (True) or read each sequence with a file read (False)."""
        self._open()

    def _open(self) -> None:
        self._remote: Optional[RemoteFile] = None
        if not IndexedDataset.exists(self.path_prefix):
            raise _missing_files_error(self.path_prefix)
        bin_path = get_bin_path(self.path_prefix)
        if is_remote(self.path_prefix):
            self._remote = RemoteFile(bin_path)
            idx_path = get_idx_path(self.path_prefix)
            self.index = _Index(cached_copy(idx_path), self._remote.size, self.multimodal, source=idx_path)
            self._bin_file, self._bin = None, None
            return
        bin_size = os.path.getsize(bin_path)
        self.index = _Index(get_idx_path(self.path_prefix), bin_size, self.multimodal)
        self._bin_file: Optional[BinaryIO] = None
        self._bin: Optional[Union[np.memmap, bytes]] = None
        if not self.mmap:
            self._bin_file = open(bin_path, "rb")
        elif bin_size == 0:
            self._bin = b""  # numpy cannot map an empty file; an empty dataset has nothing to read anyway
        else:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)

    # DataLoader workers receive the prefix and map the files themselves; maps do not pickle
    def __getstate__(self) -> tuple[str, bool, bool]:
        """Picklable state: the prefix and the open options."""
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: tuple[str, bool, bool]) -> None:
        """Reopen (and revalidate) the files after unpickling."""
        self.path_prefix, self.multimodal, self.mmap = state
        self._open()

    def __del__(self) -> None:
        if getattr(self, "_bin_file", None) is not None:
            self._bin_file.close()

    @property
    def remote(self) -> Optional[RemoteFile]:
        """The ``.bin`` in an object store (its reads and what they fetched), or None for a local one."""
        return self._remote

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:
        """Start fetching the ``(sequence, offset, length)`` reads (tokens, as :meth:`get` takes them) of an object
        store's ``.bin`` in the background; nothing for a local one."""
        if self._remote is None:
            return
        pointers, itemsize = self.index.sequence_pointers, self.index.itemsize
        self._remote.prefetch((int(pointers[i]) + offset * itemsize, length * itemsize) for i, offset, length in reads)

    def _read(self, pointer: int, count: int) -> np.ndarray:
        """``count`` tokens starting at byte ``pointer`` of the ``.bin``."""
        if self._remote is not None:
            data = self._remote.read(pointer, count * self.index.itemsize)
            return np.frombuffer(data, dtype=self.index.dtype, count=count)
        if self._bin_file is not None:
            out = np.empty(count, dtype=self.index.dtype)
            view, done = memoryview(out).cast("B"), 0
            while done < len(view):
                # positional reads: forked DataLoader workers share the descriptor and so its seek offset
                if hasattr(os, "preadv"):
                    n = os.preadv(self._bin_file.fileno(), [view[done:]], pointer + done)
                else:
                    self._bin_file.seek(pointer + done)
                    n = self._bin_file.readinto(view[done:]) or 0
                if n == 0:
                    raise ValueError(
                        f"{get_bin_path(self.path_prefix)} ended at byte {pointer + done}: it was "
                        f"truncated after it was opened; {_REBUILD}"
                    )
                done += n
            return out
        return np.frombuffer(self._bin, dtype=self.index.dtype, count=count, offset=pointer)

    def _check_index(self, idx: int) -> int:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {self.path_prefix} with {n} sequences")
        return idx + n if idx < 0 else idx

    def __len__(self) -> int:
        """Number of sequences."""
        return self.index.sequence_count

    def __getitem__(self, idx: Union[int, np.integer, slice]) -> Union[np.ndarray, list[np.ndarray], tuple[Any, Any]]:
        """Sequence ``idx`` (an array), or a contiguous slice of sequences (a list of arrays).

        Multimodal datasets return ``(array, mode)`` / ``(list, modes)`` as Megatron-LM does.
        """
        if isinstance(idx, (int, np.integer)):
            i = self._check_index(int(idx))
            seq = self._read(int(self.index.sequence_pointers[i]), int(self.index.sequence_lengths[i]))
            return (seq, self.index.sequence_modes[i]) if self.index.sequence_modes is not None else seq
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of {self.path_prefix} must be contiguous (step 1), got step {step}")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                seqs: list[np.ndarray] = []
            else:
                # one read for the whole run of sequences, then views into it
                flat = self._read(int(self.index.sequence_pointers[start]), int(lengths.sum()))
                seqs = np.split(flat, np.cumsum(lengths)[:-1])
            modes = self.index.sequence_modes
            return (seqs, modes[start:stop]) if modes is not None else seqs
        raise TypeError(f"indexed dataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> Union[np.ndarray, tuple[Any, Any]]:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end if ``length`` is None), O(1)."""
        i = self._check_index(int(idx))
        seq_len = int(self.index.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"get({idx}, offset={offset}, length={length}) is outside sequence {idx} of "
                f"{self.path_prefix}, which has {seq_len} tokens"
            )
        seq = self._read(int(self.index.sequence_pointers[i]) + offset * self.index.itemsize, length)
        return (seq, self.index.sequence_modes[i]) if self.index.sequence_modes is not None else seq

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Tokens per sequence (int32, memory-mapped)."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the ``.bin`` (int64, memory-mapped)."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """Sequence index where each document starts, plus the sequence count at the end (int64, length D)."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        """Mode of each sequence (int8) for multimodal datasets, else None."""
        return self.index.sequence_modes

    @property
    def dtype(self) -> type[np.number]:
        """Numpy dtype of the tokens."""
        return self.index.dtype

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return self.index.document_count - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.index.sequence_lengths.sum(dtype=np.int64))

    def verify(self) -> None:
        """Full O(N + D) index check beyond the ones done on open: lengths, contiguous pointers, sorted documents."""
        idx_path = get_idx_path(self.path_prefix)
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        if len(lengths) and int(lengths.min()) < 0:
            raise ValueError(f"{idx_path} has negative sequence lengths; {_REBUILD}")
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.index.itemsize, out=expected[1:])
        if not np.array_equal(expected, pointers):
            bad = int(np.flatnonzero(expected != pointers)[0])
            raise ValueError(
                f"{idx_path}: pointer of sequence {bad} is {int(pointers[bad])}, expected "
                f"{int(expected[bad])} (sequences must be stored back to back); {_REBUILD}"
            )
        if np.any(np.diff(self.document_indices) < 0):
            raise ValueError(f"{idx_path} has document indices that decrease; {_REBUILD}")

    def check_token_ids(self, vocab_size: int, chunk_tokens: int = 1 << 24) -> None:
        """Raise ValueError if any token id is negative or >= ``vocab_size`` (reads the whole ``.bin``)."""
        n = self.num_tokens
        for start in range(0, n, chunk_tokens):
            chunk = self._read(start * self.index.itemsize, min(chunk_tokens, n - start))
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab_size:
                raise ValueError(
                    f"{get_bin_path(self.path_prefix)} holds token id {high if high >= vocab_size else low}"
                    f", outside the vocabulary of {vocab_size}: the data was tokenized with a different "
                    f"tokenizer; re-run `megatron-lite preprocess` with the model's tokenizer"
                )

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``path_prefix``.bin and ``path_prefix``.idx exist (as files, or as objects of a store)."""
        if is_remote(path_prefix):
            fs = filesystem(path_prefix)
            with errors_named(path_prefix):
                fs.invalidate_cache()
                return bool(fs.isfile(get_idx_path(path_prefix)) and fs.isfile(get_bin_path(path_prefix)))
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` as items arrive and the matching ``.idx`` on :meth:`finalize` (Megatron-LM's builder)."""

    def __init__(self, bin_path: str, dtype: Any = np.int32, multimodal: bool = False) -> None:
        """Open ``bin_path`` for writing tokens of ``dtype``."""
        dtype_code(dtype)  # fail before creating any file
        self.bin_path = bin_path
        """Path of the ``.bin`` being written."""
        self.dtype: type[np.number] = np.dtype(dtype).type
        """Numpy dtype of the tokens."""
        self.multimodal = multimodal
        """Whether a mode is stored per sequence."""
        # typed arrays instead of lists of Python ints: 4/8 bytes per entry instead of ~36
        self.sequence_lengths = array("q")
        """Tokens per sequence written so far."""
        self.document_indices = array("q", [0])
        """Document boundaries so far, starting with 0."""
        self.sequence_modes: Optional[array] = array("b") if multimodal else None
        """Mode per sequence (multimodal only)."""
        self._info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self.data_file = open(bin_path, "wb")

    def _as_array(self, tokens: ArrayLike) -> np.ndarray:
        """``tokens`` as a flat array of the builder's dtype; raises ValueError if a value would not fit."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        values = np.asarray(tokens).reshape(-1)
        if self._info is not None and values.size:
            low, high = values.min(), values.max()
            if low < self._info.min or high > self._info.max:
                raise ValueError(
                    f"value {high if high > self._info.max else low} does not fit the {self._info.dtype} "
                    f"tokens of {self.bin_path}; build with dtype=optimal_dtype(vocab_size) of the "
                    f"tokenizer that produced it (int32 for vocabularies of 65,500 or more)"
                )
        return values.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False)

    def add_item(self, tensor: ArrayLike, mode: int = 0) -> None:
        """Append one sequence (call :meth:`end_document` after the last sequence of a document)."""
        values = self._as_array(tensor)
        self.data_file.write(values.tobytes(order="C"))
        self.sequence_lengths.append(values.size)
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(self, tensor: ArrayLike, lengths: Sequence[int], modes: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: ``tensor`` holds its sequences back to back, ``lengths`` their sizes."""
        values = self._as_array(tensor)
        if sum(int(n) for n in lengths) != values.size:
            raise ValueError(
                f"add_document: lengths {list(lengths)[:8]}... sum to {sum(int(n) for n in lengths)} "
                f"but the document has {values.size} tokens"
            )
        self.data_file.write(values.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, tokens: ArrayLike, lengths: ArrayLike, sequences_per_document: ArrayLike) -> None:
        """Append many documents at once: all their sequences back to back, each sequence's length, and
        how many sequences each document has (the bulk form of :meth:`add_document`, no Python loop)."""
        values = self._as_array(tokens)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != values.size or int(per_doc.sum()) != lengths.size:
            raise ValueError(
                f"add_documents: {values.size} tokens, lengths summing to {int(lengths.sum())}, "
                f"{lengths.size} sequences but sequences_per_document summing to {int(per_doc.sum())}"
            )
        self.data_file.write(values.tobytes(order="C"))
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(lengths.tobytes())
        self.document_indices.frombytes((base + np.cumsum(per_doc)).astype(np.int64).tobytes())
        if self.sequence_modes is not None:
            self.sequence_modes.frombytes(bytes(lengths.size))

    def end_document(self) -> None:
        """Close the current document (for use with :meth:`add_item`)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at ``path_prefix`` (its bytes are copied, its index offset)."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        other.verify()  # pointers are recomputed from lengths on finalize: they must have been contiguous
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix} ({np.dtype(other.dtype).name} tokens) into {self.bin_path} "
                f"({np.dtype(self.dtype).name}): the inputs were tokenized with different vocabularies; "
                f"preprocess all of them with the same tokenizer"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self.document_indices.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        if self.sequence_modes is not None and other.sequence_modes is not None:
            self.sequence_modes.frombytes(other.sequence_modes.astype(np.int8).tobytes())
        with open_read(location(get_bin_path(path_prefix))) as src:  # an object: streamed
            shutil.copyfileobj(src, self.data_file, 1 << 24)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx`` (to a temporary name, renamed when complete)."""
        self.data_file.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError(
                f"a sequence of {int(lengths.max())} tokens does not fit the int32 lengths of {idx_path}; "
                f"split long documents into sentences (--split-sentences) or shorter documents"
            )
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1] * np.dtype(self.dtype).itemsize, out=pointers[1:])
        documents = np.frombuffer(self.document_indices, dtype=np.int64)
        tmp_path = f"{idx_path}.tmp{os.getpid()}"
        with open(tmp_path, "wb") as out:
            out.write(_INDEX_HEADER)
            out.write(struct.pack("<QBQQ", _VERSION, dtype_code(self.dtype), len(lengths), len(documents)))
            out.write(lengths.astype("<i4").tobytes())
            out.write(pointers.tobytes())
            out.write(documents.astype("<i8").tobytes())
            if self.sequence_modes is not None:
                out.write(np.frombuffer(self.sequence_modes, dtype=np.int8).tobytes())
        os.replace(tmp_path, idx_path)

    def abort(self) -> None:
        """Close and delete the partly written ``.bin`` (after an error)."""
        self.data_file.close()
        if os.path.exists(self.bin_path):
            os.remove(self.bin_path)


def write_dataset(path_prefix: str, documents: Iterable[Iterable[ArrayLike]], dtype: Any = np.int32) -> None:
    """Write ``documents`` (each an iterable of sequences) as ``path_prefix``.bin/.idx."""
    builder = IndexedDatasetBuilder(get_bin_path(path_prefix), dtype=dtype)
    try:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()
    except BaseException:
        builder.abort()
        raise
    builder.finalize(get_idx_path(path_prefix))


def merge_datasets(input_prefixes: Sequence[str], output_prefix: str) -> str:
    """Concatenate the datasets at ``input_prefixes`` into ``output_prefix``.bin/.idx; returns ``output_prefix``.

    The output is written under temporary names and renamed when complete, so a failure leaves no pair.
    """
    if not input_prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in input_prefixes):
        raise ValueError(f"merge output {output_prefix} is also an input; choose another --output-prefix")
    first = IndexedDataset(input_prefixes[0])
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=first.dtype)
    del first
    try:
        for prefix in input_prefixes:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(tmp))
    except BaseException:
        builder.abort()
        if os.path.exists(get_idx_path(tmp)):
            os.remove(get_idx_path(tmp))
        raise
    # .bin first: a crash between the renames leaves a pair that fails the size check on open, never a wrong sample
    os.replace(get_bin_path(tmp), get_bin_path(output_prefix))
    os.replace(get_idx_path(tmp), get_idx_path(output_prefix))
    return output_prefix


__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "dtype_code",
    "get_bin_path",
    "get_idx_path",
    "merge_datasets",
    "optimal_dtype",
    "write_dataset",
]
