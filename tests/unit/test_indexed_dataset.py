"""Megatron-LM's ``.bin``/``.idx`` format: hand-computed bytes, round trips, slices, merging, every bad input."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lite.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    dtype_code,
    merge_datasets,
    optimal_dtype,
    write_dataset,
)

MAGIC = b"MMIDIDX\x00\x00"


def _tiny(prefix: str, dtype=np.uint16) -> None:
    """Two documents, one sequence each: [1, 2, 3] and [4, 5]."""
    write_dataset(prefix, [[[1, 2, 3]], [[4, 5]]], dtype=dtype)


def test_hand_computed_idx_matches_byte_for_byte(tmp_path: Path) -> None:
    prefix = str(tmp_path / "tiny")
    _tiny(prefix)
    expected_idx = (
        MAGIC
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # dtype code: uint16
        + struct.pack("<Q", 2)  # sequence count N
        + struct.pack("<Q", 3)  # document index count D = documents + 1
        + struct.pack("<2i", 3, 2)  # sequence lengths
        + struct.pack("<2q", 0, 6)  # byte pointers: 3 uint16 tokens = 6 bytes
        + struct.pack("<3q", 0, 1, 2)  # document indices
    )
    assert Path(prefix + ".idx").read_bytes() == expected_idx
    assert Path(prefix + ".bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 4, 5)


def test_hand_computed_idx_with_sentences_int32(tmp_path: Path) -> None:
    # one document of two sentences, one of one sentence; int32 tokens
    prefix = str(tmp_path / "sent")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(np.array([7, 8, 9, 70000]), [2, 2])
    builder.add_item(torch.tensor([5]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    expected_idx = (
        MAGIC
        + struct.pack("<QBQQ", 1, 4, 3, 3)
        + struct.pack("<3i", 2, 2, 1)
        + struct.pack("<3q", 0, 8, 16)
        + struct.pack("<3q", 0, 2, 3)
    )
    assert Path(prefix + ".idx").read_bytes() == expected_idx
    assert Path(prefix + ".bin").read_bytes() == struct.pack("<5i", 7, 8, 9, 70000, 5)
    ds = IndexedDataset(prefix)
    assert [s.tolist() for s in ds[:]] == [[7, 8], [9, 70000], [5]]
    assert ds.document_indices.tolist() == [0, 2, 3] and ds.num_documents == 2


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path: Path, dtype) -> None:
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 100_000)
    docs = [
        [rng.integers(0, high, size=int(n)) for n in rng.integers(0, 50, size=int(k))]
        for k in rng.integers(1, 4, size=30)
    ]
    prefix = str(tmp_path / "rt")
    write_dataset(prefix, docs, dtype=dtype)
    ds = IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat) and ds.dtype == dtype
    assert ds.sequence_lengths.dtype == np.int32 and ds.sequence_pointers.dtype == np.int64
    assert ds.document_indices.dtype == np.int64
    assert ds.document_indices.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    for i, seq in enumerate(flat):
        assert ds[i].dtype == dtype and ds[i].tolist() == seq.tolist()
    assert [s.tolist() for s in ds[3:9]] == [s.tolist() for s in flat[3:9]]
    assert ds.num_tokens == sum(len(s) for s in flat)
    ds.verify()
    # header fields straight from the bytes
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == MAGIC
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, dtype_code(dtype), len(flat), len(docs) + 1)
    assert os.path.getsize(prefix + ".bin") == ds.num_tokens * np.dtype(dtype).itemsize


def test_get_slices_and_indexing(tmp_path: Path) -> None:
    prefix = str(tmp_path / "g")
    write_dataset(prefix, [[np.arange(10)], [np.arange(100, 105)]], dtype=np.uint16)
    ds = IndexedDataset(prefix)
    assert ds.get(0).tolist() == list(range(10))
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(1, offset=2).tolist() == [102, 103, 104]
    assert ds.get(1, offset=5).tolist() == []
    assert ds[-1].tolist() == list(range(100, 105)) and ds[np.int64(0)].tolist() == list(range(10))
    assert ds[5:] == [] and ds[0:0] == []
    with pytest.raises(IndexError, match="outside sequence 0"):
        ds.get(0, offset=8, length=3)
    with pytest.raises(IndexError, match="outside sequence 1"):
        ds.get(1, offset=-1)
    with pytest.raises(IndexError, match="out of range"):
        ds[2]
    with pytest.raises(ValueError, match="contiguous"):
        ds[::2]
    with pytest.raises(TypeError):
        ds["0"]  # type: ignore[index]
    unmapped = IndexedDataset(prefix, mmap=False)
    assert unmapped.get(0, 3, 4).tolist() == [3, 4, 5, 6] and [s.tolist() for s in unmapped[0:2]] == [
        s.tolist() for s in ds[0:2]
    ]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[1].tolist() == ds[1].tolist() and clone.path_prefix == prefix
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_empty_dataset_and_multimodal(tmp_path: Path) -> None:
    empty = str(tmp_path / "empty")
    write_dataset(empty, [], dtype=np.uint16)
    ds = IndexedDataset(empty)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0] and ds[:] == []
    mm = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(mm + ".bin", dtype=np.uint16, multimodal=True)
    builder.add_item([1, 2], mode=3)
    builder.add_document([4, 5, 6], [1, 2], modes=[1, 2])
    builder.finalize(mm + ".idx")
    seq, mode = IndexedDataset(mm, multimodal=True)[2]
    assert seq.tolist() == [5, 6] and mode == 2
    with pytest.raises(ValueError, match="multimodal=True"):
        IndexedDataset(mm)


def test_optimal_dtype_and_codes() -> None:
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    assert {c: dtype_code(d) for c, d in DTYPE_CODES.items()} == {c: c for c in DTYPE_CODES}
    with pytest.raises(ValueError, match="cannot be stored"):
        dtype_code(np.uint32)


def test_builder_rejects_ids_that_do_not_fit(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="does not fit the uint16"):
        builder.add_item([1, 65536])
    with pytest.raises(ValueError, match="does not fit"):
        builder.add_item([-1])
    with pytest.raises(ValueError, match="sum to"):
        builder.add_document([1, 2, 3], [2])
    builder.abort()
    assert not (tmp_path / "x.bin").exists()


def test_merge(tmp_path: Path) -> None:
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "out"))
    _tiny(a)
    write_dataset(b, [[[9], [10, 11]], [[12]]], dtype=np.uint16)
    assert merge_datasets([a, b, a], out) == out
    ds = IndexedDataset(out)
    assert [s.tolist() for s in ds[:]] == [[1, 2, 3], [4, 5], [9], [10, 11], [12], [1, 2, 3], [4, 5]]
    assert ds.document_indices.tolist() == [0, 1, 2, 4, 5, 6, 7]
    ds.verify()
    # merging equals writing the concatenation directly, byte for byte
    direct = str(tmp_path / "direct")
    write_dataset(direct, [[[1, 2, 3]], [[4, 5]], [[9], [10, 11]], [[12]], [[1, 2, 3]], [[4, 5]]], dtype=np.uint16)
    for ext in (".bin", ".idx"):
        assert Path(out + ext).read_bytes() == Path(direct + ext).read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))


def test_merge_errors(tmp_path: Path) -> None:
    a, wide, out = (str(tmp_path / n) for n in ("a", "wide", "out"))
    _tiny(a)
    _tiny(wide, dtype=np.int32)
    with pytest.raises(ValueError, match="different vocabularies"):
        merge_datasets([a, wide], out)
    assert not list(tmp_path.glob("out*"))  # nothing half-written left behind
    with pytest.raises(ValueError, match="also an input"):
        merge_datasets([a], a)
    with pytest.raises(FileNotFoundError, match="missing"):
        merge_datasets([a, str(tmp_path / "nope")], out)
    assert not list(tmp_path.glob("out*"))


# --- bad input: each names the file and the fix ---------------------------------------------------------


def _patched(tmp_path: Path, offset: int, data: bytes) -> str:
    prefix = str(tmp_path / "bad")
    _tiny(prefix)
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    raw[offset : offset + len(data)] = data
    Path(prefix + ".idx").write_bytes(bytes(raw))
    return prefix


def test_bad_magic(tmp_path: Path) -> None:
    prefix = _patched(tmp_path, 0, b"TNTIDX\x00\x00")
    with pytest.raises(ValueError, match=r"bad\.idx is not a Megatron indexed dataset index \(bad magic") as err:
        IndexedDataset(prefix)
    assert "megatron-lite preprocess" in str(err.value)


def test_foreign_file_as_idx(tmp_path: Path) -> None:
    prefix = str(tmp_path / "foreign")
    Path(prefix + ".bin").write_bytes(b"")
    Path(prefix + ".idx").write_text('{"not": "an index"}')
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(prefix)


def test_bad_version(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"bad\.idx has index version 2"):
        IndexedDataset(_patched(tmp_path, 9, struct.pack("<Q", 2)))


def test_bad_dtype_code(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"bad\.idx has unknown dtype code 9"):
        IndexedDataset(_patched(tmp_path, 17, struct.pack("<B", 9)))


def test_changed_dtype_code_is_caught_by_bin_size(tmp_path: Path) -> None:
    # uint16 data read as int32 would be silently wrong: the .bin size no longer matches
    with pytest.raises(ValueError, match=r"bad\.bin has 10 bytes but .*bad\.idx describes 14 bytes"):
        IndexedDataset(_patched(tmp_path, 17, struct.pack("<B", 4)))


@pytest.mark.parametrize("cut", [1, 8, 60, 30, 5])
def test_truncated_idx(tmp_path: Path, cut: int) -> None:
    prefix = str(tmp_path / "t")
    _tiny(prefix)
    raw = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(raw[: len(raw) - cut])
    with pytest.raises(ValueError, match=r"t\.idx is truncated|bad magic"):
        IndexedDataset(prefix)


def test_idx_with_trailing_bytes(tmp_path: Path) -> None:
    prefix = str(tmp_path / "long")
    _tiny(prefix)
    with open(prefix + ".idx", "ab") as f:
        f.write(b"\x00" * 8)
    with pytest.raises(ValueError, match=r"long\.idx is 8 bytes longer than its header says"):
        IndexedDataset(prefix)


def test_counts_that_disagree_with_the_file(tmp_path: Path) -> None:
    # a sequence count that promises more than the file holds
    with pytest.raises(ValueError, match="truncated: its header promises 3 sequences"):
        IndexedDataset(_patched(tmp_path, 18, struct.pack("<Q", 3)))


def test_inconsistent_document_indices(tmp_path: Path) -> None:
    # last document index (offset 34 + 8 + 16 + 16) says 1 instead of N = 2
    with pytest.raises(ValueError, match="inconsistent document indices"):
        IndexedDataset(_patched(tmp_path, 34 + 8 + 16 + 16, struct.pack("<q", 1)))


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_bin_size_mismatch(tmp_path: Path, change: str) -> None:
    prefix = str(tmp_path / "b")
    _tiny(prefix)
    raw = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(raw[:-2] if change == "truncate" else raw + b"\x00\x00")
    with pytest.raises(
        ValueError, match=r"b\.bin has (8|12) bytes but .*b\.idx describes 10 bytes.*do not belong together"
    ):
        IndexedDataset(prefix)


def test_non_contiguous_pointers_fail_verify(tmp_path: Path) -> None:
    # first pointer 0, last pointer + length still matches the .bin: only the full check sees it
    prefix = str(tmp_path / "p")
    write_dataset(prefix, [[[1, 2]], [[3]], [[4, 5]]], dtype=np.uint16)
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    raw[34 + 12 + 8 : 34 + 12 + 16] = struct.pack("<q", 2)  # pointer of sequence 1: 4 -> 2
    Path(prefix + ".idx").write_bytes(bytes(raw))
    ds = IndexedDataset(prefix)
    with pytest.raises(ValueError, match="pointer of sequence 1 is 2, expected 4"):
        ds.verify()
    with pytest.raises(ValueError, match="pointer of sequence 1"):
        merge_datasets([prefix], str(tmp_path / "m"))


@pytest.mark.parametrize("missing", [".bin", ".idx", "both"])
def test_missing_files(tmp_path: Path, missing: str) -> None:
    prefix = str(tmp_path / "m")
    _tiny(prefix)
    for ext in (".bin", ".idx") if missing == "both" else (missing,):
        os.remove(prefix + ext)
    with pytest.raises(FileNotFoundError) as err:
        IndexedDataset(prefix)
    message = str(err.value)
    for ext in (".bin", ".idx"):
        assert ((prefix + ext) in message) == (missing in (ext, "both"))


def test_prefix_with_extension(tmp_path: Path) -> None:
    prefix = str(tmp_path / "e")
    _tiny(prefix)
    with pytest.raises(FileNotFoundError, match="without the extension"):
        IndexedDataset(prefix + ".bin")


def test_check_token_ids(tmp_path: Path) -> None:
    prefix = str(tmp_path / "v")
    _tiny(prefix)
    IndexedDataset(prefix).check_token_ids(6)
    with pytest.raises(ValueError, match=r"v\.bin holds token id 5, outside the vocabulary of 5"):
        IndexedDataset(prefix).check_token_ids(5, chunk_tokens=2)
