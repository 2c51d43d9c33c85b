"""GPTDataset: Megatron's document/sample/shuffle indices, sample contents, the on-disk cache, rank-0 builds."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_lite.data import gpt_dataset as gpt_module
from megatron_lite.data.gpt_dataset import (
    GPTDataset,
    build_document_index,
    build_gpt_indices,
    build_sample_index,
    num_epochs_for,
)
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def write_docs(prefix: Path, docs: list[np.ndarray], dtype: Any = np.uint16) -> IndexedDataset:
    """Write ``docs`` (one sequence each) with the real builder and open them."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def numbered_docs(lengths: list[int]) -> list[np.ndarray]:
    """Document ``d`` holds tokens ``100*d + 0, 100*d + 1, ...``: every token says where it came from."""
    return [np.arange(n, dtype=np.int64) + 100 * d for d, n in enumerate(lengths)]


def megatron_sample_index(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """A line-by-line Python port of Megatron's ``build_sample_idx`` token walk (helpers.cpp), the reference."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    index, doc_i, offset = 1, 0, 0
    while index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[doc_i]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                if doc_i == len(doc_idx) - 1:
                    offset = int(sizes[doc_idx[doc_i]]) - 1
                    break
                doc_i += 1
                offset = 0
        out[index] = (doc_i, offset)
        index += 1
    return out


@pytest.mark.parametrize("seq_length", [1, 3, 8, 50])
def test_sample_index_equals_megatrons_token_walk(seq_length: int) -> None:
    rng = np.random.default_rng(seq_length)
    for trial in range(20):
        sizes = rng.integers(0, 12, size=int(rng.integers(1, 30))).astype(np.int32)
        sizes[rng.integers(len(sizes))] += 1  # at least one token
        docs = np.arange(len(sizes))
        tokens = int(sizes.sum())
        if tokens < seq_length + 1:
            continue
        num_epochs = int(rng.integers(1, 4))
        doc_idx = build_document_index(docs, num_epochs, np.random.RandomState(trial), False)
        ours = build_sample_index(sizes, doc_idx, seq_length, (num_epochs * tokens - 1) // seq_length)
        assert np.array_equal(ours, megatron_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens))


def test_document_and_shuffle_index_follow_megatrons_random_state() -> None:
    sizes = np.full(10, 10, dtype=np.int32)
    docs = np.arange(2, 8)  # a split: documents 2..7, 60 tokens per epoch
    # one epoch: the documents shuffled once, then the samples, from one RandomState(seed)
    one = build_gpt_indices(sizes, docs, None, 4, seed=5)
    rng = np.random.RandomState(5)
    expected_docs = docs.astype(np.int32).copy()
    rng.shuffle(expected_docs)
    expected_shuffle = np.arange(59 // 4, dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    assert np.array_equal(one["document_index"], expected_docs) and one["document_index"].dtype == np.int32
    assert np.array_equal(one["shuffle_index"], expected_shuffle)
    # 20 samples need 81 tokens: 2 epochs; the second adds 5 of 14 samples (< 80%) -> shuffled on its own
    two = build_gpt_indices(sizes, docs, 20, 4, seed=5)
    rng = np.random.RandomState(5)
    first, last = np.tile(docs.astype(np.int32), 1), docs.astype(np.int32).copy()
    rng.shuffle(first)
    rng.shuffle(last)
    assert np.array_equal(two["document_index"], np.concatenate([first, last]))
    before_final = (60 - 1) // 4
    assert sorted(two["shuffle_index"][:before_final]) == list(range(before_final))
    assert sorted(two["shuffle_index"][before_final:]) == list(range(before_final, (120 - 1) // 4))
    # 25 samples: the final epoch adds 11 of 14 (>= 80%) -> both epochs shuffled together
    together = build_gpt_indices(sizes, docs, 25, 4, seed=5)
    rng = np.random.RandomState(5)
    both = np.tile(docs.astype(np.int32), 2)
    rng.shuffle(both)
    assert np.array_equal(together["document_index"], both)
    assert num_epochs_for(60, 14, 4) == 1 and num_epochs_for(60, 15, 4) == 2 and num_epochs_for(60, None, 4) == 1


def test_samples_cut_the_shuffled_document_stream(tmp_path: Path) -> None:
    lengths = [7, 1, 0, 12, 5, 3, 9, 4, 0, 6]
    data = write_docs(tmp_path / "d", numbered_docs(lengths))
    split = np.arange(1, 9)  # documents 1..8: 34 tokens, two of them empty
    seq = 5
    ds = GPTDataset(
        data, str(tmp_path / "d"), split, num_samples=20, seq_length=seq, seed=3, cache_dir=str(tmp_path / "cache")
    )
    assert ds.num_tokens_per_epoch == 34 and len(ds) == (3 * 34 - 1) // seq == 20  # 20 * 5 + 1 tokens: 3 epochs
    # each epoch (or the whole run) uses every document of the split the same number of times, no others
    assert sorted(ds.document_index.tolist()) == sorted(split.tolist() * 3)
    stream = np.concatenate([np.arange(lengths[d]) + 100 * d for d in ds.document_index])
    seen = set()
    for i in range(len(ds)):
        sample = ds[i]["tokens"]
        j = int(ds.shuffle_index[i])
        assert sample.dtype == torch.int64 and sample.shape == (seq + 1,)
        assert torch.equal(sample, torch.from_numpy(stream[j * seq : j * seq + seq + 1]))
        seen.add(j)
    assert seen == set(range(len(ds)))  # the shuffle is a permutation
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_index_cache_is_reused_and_keyed_by_the_config(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    data = write_docs(prefix, numbered_docs([20] * 10))
    docs = np.arange(10)
    first = GPTDataset(data, str(prefix), docs, None, 8, seed=1)
    cache = prefix / "cache" / "GPTDataset_indices"  # Megatron's default place
    assert first.cache_dir == str(cache)
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.suffix != ".lock"}
    assert len(files) == 4 and all(n.startswith(first.unique_description_hash) for n in files)
    assert (
        cache / f"{first.unique_description_hash}-GPTDataset-train-description.json"
    ).read_text() == first.description
    again = GPTDataset(data, str(prefix), docs, None, 8, seed=1)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.suffix != ".lock"} == files
    assert isinstance(again.sample_index, np.memmap)  # loaded, not rebuilt
    assert all(torch.equal(first[i]["tokens"], again[i]["tokens"]) for i in range(len(first)))
    for change in ({"seed": 2}, {"seq_length": 9}, {"num_samples": 40}, {"indexed_indices": np.arange(9)}):
        args = {"indexed_indices": docs, "num_samples": None, "seq_length": 8, "seed": 1, **change}
        other = GPTDataset(data, str(prefix), **args)
        assert other.unique_description_hash != first.unique_description_hash
    assert (
        GPTDataset(data, str(prefix), docs, None, 8, seed=1, split="validation").unique_description_hash
        != first.unique_description_hash
    )
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]


def _build_in_rank(rank: int, prefix: str, store: str, log: str, queue: Any) -> None:
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        original = gpt_module.build_gpt_indices

        def logged(*args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
            with open(log, "a") as f:
                f.write(f"{rank}\n")
            return original(*args, **kwargs)

        gpt_module.build_gpt_indices = logged
        ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(30), 200, 16, seed=7)
        queue.put((rank, ds.shuffle_index.tolist(), ds[5]["tokens"].tolist()))
        torch.distributed.destroy_process_group()
    except BaseException as err:  # report instead of hanging the parent
        queue.put((rank, repr(err), None))


def test_global_rank_zero_builds_while_the_others_wait(tmp_path: Path) -> None:
    prefix = str(tmp_path / "corpus")
    write_docs(Path(prefix), numbered_docs(list(range(5, 35))))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    log = str(tmp_path / "builds.log")
    procs = [
        ctx.Process(target=_build_in_rank, args=(r, prefix, str(tmp_path / "store"), log, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict((r, (a, b)) for r, a, b in (queue.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    assert isinstance(results[0][0], list), results
    assert results[0] == results[1]
    assert Path(log).read_text() == "0\n"


def test_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    prefix = tmp_path / "small"
    data = write_docs(prefix, numbered_docs([3, 4, 5]))
    with pytest.raises(
        ValueError,
        match=rf"the validation split of {prefix} holds 1 documents with 3 tokens.*"
        r"larger share",
    ):
        GPTDataset(data, str(prefix), np.arange(0, 1), None, 8, seed=0, split="validation")
    with pytest.raises(ValueError, match="holds 0 documents"):
        GPTDataset(data, str(prefix), np.arange(0), None, 8, seed=0)
    with pytest.raises(IndexError, match=r"document ids must lie in \[0, 3\)"):
        GPTDataset(data, str(prefix), np.arange(2, 5), None, 2, seed=0)
    with pytest.raises(ValueError, match="num_samples must be None"):
        GPTDataset(data, str(prefix), np.arange(3), 0, 2, seed=0)


def test_eod_mask_and_unwritable_cache(tmp_path: Path) -> None:
    eod = 0
    docs = [np.array([5, 6, 7, eod]), np.array([8, 9, eod]), np.array([10, 11, 12, 13, eod])]
    data = write_docs(tmp_path / "eod", docs)
    ds = GPTDataset(
        data,
        str(tmp_path / "eod"),
        np.arange(3),
        None,
        4,
        seed=0,
        eod_mask_token=eod,
        cache_dir=str(tmp_path / "cache"),
    )
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(item["loss_mask"], (item["tokens"][:-1] != eod).float())
    assert (
        "loss_mask"
        not in GPTDataset(
            data, str(tmp_path / "eod"), np.arange(3), None, 4, seed=0, cache_dir=str(tmp_path / "cache")
        )[0]
    )
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="building the indices in memory"):
        in_memory = GPTDataset(
            data, str(tmp_path / "eod"), np.arange(3), None, 4, seed=0, cache_dir=str(blocker / "cache")
        )
    assert np.array_equal(in_memory.shuffle_index, ds.shuffle_index)
    assert os.path.isfile(blocker)
