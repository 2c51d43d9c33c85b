"""Data side: geometry, Megatron's sampler, mock data, the JSONL corpus datamodule, exact resume in a Trainer."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from megatron_lite.data import (
    DataGeometry,
    MegatronPretrainingSampler,
    MockGPTDataModule,
    MockGPTDataset,
    TextCorpusDataModule,
    bundled_corpora,
    bundled_corpus,
    resolve_corpus,
)
from megatron_lite.data.splits import parse_split

# ---------------------------------------------------------------------------------------------- geometry


def test_geometry_validates_and_counts_microbatches() -> None:
    g = DataGeometry(micro_batch_size=2, global_batch_size=16, seq_length=32)
    assert [g.num_microbatches(dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert g.local_batch_size(4) == 4
    with pytest.raises(ValueError, match=r"= 6; change global_batch_size to a multiple of 6"):
        g.num_microbatches(3)
    with pytest.raises(ValueError, match="change global_batch_size to a multiple of 3"):
        DataGeometry(micro_batch_size=3, global_batch_size=16, seq_length=32)
    for bad in ({"micro_batch_size": 0}, {"seq_length": -1}, {"global_batch_size": 2.0}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            DataGeometry(**{"micro_batch_size": 2, "global_batch_size": 16, "seq_length": 32, **bad})
    with pytest.raises(AttributeError):
        g.seq_length = 64  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------- sampler


def _global_batches(total: int, gbs: int, dp: int, consumed: int = 0) -> list[list[int]]:
    """Global batches as seen by concatenating every rank's slice, in order."""
    per_rank = []
    for rank in range(dp):
        s = MegatronPretrainingSampler(total, consumed, gbs, dp, rank)
        idx = list(s)
        per_rank.append([idx[i : i + gbs // dp] for i in range(0, len(idx), gbs // dp)])
    return [sum((per_rank[r][k] for r in range(dp)), []) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_ranks_tile_the_dp1_order(dp: int) -> None:
    total, gbs = 50, 8  # 48 usable samples: the 2 of an incomplete global batch are dropped
    reference = [list(range(k * gbs, (k + 1) * gbs)) for k in range(6)]
    assert _global_batches(total, gbs, dp) == reference
    sampler = MegatronPretrainingSampler(total, 0, gbs, dp, dp - 1)
    assert isinstance(sampler, DistributedSampler)
    assert len(sampler) == 48 // dp


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_resume_gives_exactly_the_remainder(dp: int) -> None:
    total, gbs = 50, 8
    full = _global_batches(total, gbs, dp)
    for step in range(len(full)):
        assert _global_batches(total, gbs, dp, consumed=step * gbs) == full[step:]
        # consumed counts over passes: the same point one pass later resumes the same way
        assert _global_batches(total, gbs, dp, consumed=step * gbs + 48) == full[step:]


def test_sampler_counter_advances_and_next_pass_restarts() -> None:
    s = MegatronPretrainingSampler(total_samples=20, consumed_samples=8, global_batch_size=4, num_replicas=2, rank=1)
    assert list(s) == [10, 11, 14, 15, 18, 19]
    assert s.consumed_samples == 20
    s.set_epoch(7)  # Lightning calls this; the order does not depend on it
    assert list(s) == [2, 3, 6, 7, 10, 11, 14, 15, 18, 19]
    # a partially consumed pass continues where it stopped; a rewinding sampler starts over
    it = iter(s)
    assert [next(it), next(it)] == [2, 3] and s.consumed_samples == 44
    assert list(s)[:2] == [6, 7]
    r = MegatronPretrainingSampler(20, 8, 4, 2, 1, rewind=True)
    assert list(r) == list(r) == [10, 11, 14, 15, 18, 19]
    s.load_state_dict({"consumed_samples": 16})
    assert s.state_dict() == {"consumed_samples": 16} and list(s) == [18, 19]
    # a position off the global-batch grid (batch size changed) runs complete batches, then a fresh pass
    odd = MegatronPretrainingSampler(12, 5, 4, 1, 0)
    assert list(odd) == [5, 6, 7, 8] and odd.consumed_samples == 9
    assert list(odd) == list(range(12)) and odd.consumed_samples == 24


def test_sampler_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="change global_batch_size to a multiple of 3"):
        MegatronPretrainingSampler(100, 0, 8, 3, 0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        MegatronPretrainingSampler(7, 0, 8, 1, 0)
    with pytest.raises(ValueError, match="rank"):
        MegatronPretrainingSampler(100, 0, 8, 2, 2)
    with pytest.raises(ValueError, match="drop_last=True"):
        MegatronPretrainingSampler(100, 0, 8, 2, 0, drop_last=False)
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(100, -8, 8, 2, 0)


# ------------------------------------------------------------------------------------------------- mock


def test_mock_dataset_is_deterministic_per_seed_and_index() -> None:
    a = MockGPTDataset(100, 16, 50, seed=3)
    forward = [a[i]["tokens"] for i in range(10)]
    b = MockGPTDataset(1000, 16, 50, seed=3)  # the number of samples does not matter either
    backward = [b[i]["tokens"] for i in reversed(range(10))][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward))
    assert forward[0].dtype == torch.int64 and forward[0].shape == (17,)
    assert int(forward[0].min()) >= 0 and int(torch.stack(forward).max()) < 50
    other = MockGPTDataset(100, 16, 50, seed=4)
    assert not any(torch.equal(forward[i], other[i]["tokens"]) for i in range(10))
    assert not torch.equal(forward[0], forward[1])
    with pytest.raises(IndexError):
        a[100]


def test_mock_datamodule_batches_without_trainer() -> None:
    dm = MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=64, num_train_samples=40, num_val_samples=16
    )
    assert (dm.seq_length, dm.micro_batch_size, dm.global_batch_size, dm.vocab_size, dm.tokenizer) == (
        16,
        2,
        8,
        64,
        None,
    )
    assert dm.geometry == DataGeometry(micro_batch_size=2, global_batch_size=8, seq_length=16)
    train = list(dm.train_dataloader())
    assert len(train) == 5 and all(b["tokens"].shape == (8, 17) and b["tokens"].dtype == torch.int64 for b in train)
    assert torch.equal(train[1]["tokens"][0], dm.train_dataset[8]["tokens"])
    val = list(dm.val_dataloader())
    assert len(val) == 2 and val[0]["tokens"].shape == (8, 17)
    assert not torch.equal(val[0]["tokens"], train[0]["tokens"])


def test_mock_datamodule_reads_dp_from_the_trainer_strategy() -> None:
    """A stand-in trainer with the two attributes the contract reads: strategy kwargs and global_step."""
    kwargs = dict(seq_length=4, micro_batch_size=1, global_batch_size=8, num_train_samples=64)
    full = [b["tokens"] for b in MockGPTDataModule(**kwargs).train_dataloader()]
    per_rank = []
    for rank in range(4):
        dm = MockGPTDataModule(**kwargs)
        dm.trainer = SimpleNamespace(  # type: ignore[assignment]
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": rank}), global_step=3
        )
        per_rank.append([b["tokens"] for b in dm.train_dataloader()])
    assert all(t.shape == (2, 5) for t in per_rank[0])
    merged = [torch.cat([r[k] for r in per_rank]) for k in range(5)]
    assert len(full) == 8 and all(torch.equal(m, f) for m, f in zip(merged, full[3:]))


def test_mock_datamodule_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 2"):
        MockGPTDataModule(vocab_size=1)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        MockGPTDataModule(micro_batch_size=0)
    with pytest.raises(ValueError, match="change global_batch_size to a multiple of 3"):
        MockGPTDataModule(micro_batch_size=3, global_batch_size=8)
    with pytest.raises(ValueError, match="num_val_samples must be an integer >= global_batch_size"):
        MockGPTDataModule(num_val_samples=3)


# --------------------------------------------------------------------------------------- Lightning fit


class _Recorder(pl.LightningModule):
    """Records every training batch; the loss is a function of one parameter so the optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batches.append(batch["tokens"].clone())
        return self.w * batch["tokens"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SaveAt(pl.Callback):
    """Saves a checkpoint after optimizer step ``step`` while training goes on (like ModelCheckpoint)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(max_steps: int, ckpt_path: Path | None = None, **trainer_kwargs: Any) -> _Recorder:
    model = _Recorder()
    # 3 global batches per pass, so runs cross Lightning epochs (= sampler passes)
    dm = MockGPTDataModule(
        seq_length=8, micro_batch_size=2, global_batch_size=4, vocab_size=50, num_train_samples=14, num_val_samples=4
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    with warnings.catch_warnings():
        # the loaders are resumable; Lightning must not claim otherwise
        warnings.filterwarnings("error", message=".*dataloader is not resumable.*")
        trainer.fit(model, dm, ckpt_path=ckpt_path)
    model.trainer_ = trainer  # type: ignore[attr-defined]
    return model


def test_trainer_gets_one_global_batch_per_step() -> None:
    model = _fit(3)
    ds = MockGPTDataset(14, 8, 50, seed=1234)
    assert [b.shape for b in model.batches] == [(4, 9)] * 3
    assert torch.equal(model.batches[2], torch.stack([ds[i]["tokens"] for i in range(8, 12)]))


def test_resume_continues_exactly_where_the_run_stopped(tmp_path: Path) -> None:
    reference = _fit(8).batches
    # checkpoint written after fit() returned at step 2
    first = _fit(2)
    first.trainer_.save_checkpoint(tmp_path / "step2.ckpt")  # type: ignore[attr-defined]
    ckpt = torch.load(tmp_path / "step2.ckpt", weights_only=False)
    assert ckpt["MockGPTDataModule"] == {"consumed_samples": 8}
    resumed = _fit(8, ckpt_path=tmp_path / "step2.ckpt")
    assert len(resumed.batches) == 6
    assert all(torch.equal(a, b) for a, b in zip(resumed.batches, reference[2:]))
    # checkpoint written mid-run, in the second epoch, by a callback
    _fit(6, callbacks=[_SaveAt(4, tmp_path / "step4.ckpt")])
    resumed = _fit(8, ckpt_path=tmp_path / "step4.ckpt")
    assert len(resumed.batches) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed.batches, reference[4:]))


# ------------------------------------------------------------------------------------------ text corpus

_SEQ = 16


@pytest.fixture(scope="module")
def corpus_docs() -> list[str]:
    """20 real documents of ~600 characters: slices of the first plays of the bundled corpus."""
    with gzip.open(bundled_corpus("shakespeare"), "rt", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(4)]
    return [text[5000 + 600 * i : 5600 + 600 * i] for text in texts for i in range(5)]


def _write_jsonl(path: Path, objects: list[dict[str, Any]]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in objects)
    return path


def _datamodule(path: Path, **kwargs: Any) -> TextCorpusDataModule:
    args: dict[str, Any] = dict(seq_length=_SEQ, micro_batch_size=2, global_batch_size=4, vocab_size=400, split="80,20")
    return TextCorpusDataModule(str(path), **{**args, **kwargs})


def test_text_corpus_trains_tokenizer_splits_and_windows(tmp_path: Path, corpus_docs: list[str]) -> None:
    path = _write_jsonl(tmp_path / "corpus.jsonl", [{"id": i, "text": t} for i, t in enumerate(corpus_docs)])
    dm = _datamodule(path)
    assert dm.tokenizer is None and dm.cache_dir == str(tmp_path / ".megatron_lite_cache")
    dm.prepare_data()
    assert dm.tokenizer is not None and dm.vocab_size == dm.tokenizer.vocab_size == 400
    dm.setup("fit")
    train, val = dm.train_dataset, dm.val_dataset
    assert train is not None and val is not None
    eod = dm.tokenizer.eod
    # documents split 16/4 by the 80,20 split, each followed by one EOD; every document decodes exactly
    assert int((train.tokens == eod).sum()) == 16 and int((val.tokens == eod).sum()) == 4
    decoded = {
        name: [
            dm.tokenizer.detokenize(doc[:-1].tolist())
            for doc in np.split(np.asarray(ds.tokens, dtype=np.int64), np.flatnonzero(ds.tokens == eod) + 1)
            if len(doc)
        ]
        for name, ds in (("train", train), ("val", val))
    }
    assert sorted(decoded["train"] + decoded["val"]) == sorted(corpus_docs)
    # windows of seq+1 tokens with stride seq: neighbours share one token, together they tile the split
    assert len(train) == (len(train.tokens) - 1) // _SEQ
    a, b = train[3]["tokens"], train[4]["tokens"]
    assert a.shape == (_SEQ + 1,) and a.dtype == torch.int64 and a[-1] == b[0]
    assert torch.equal(a, torch.from_numpy(np.asarray(train.tokens[3 * _SEQ : 4 * _SEQ + 1], dtype=np.int64)))
    batch = next(iter(dm.train_dataloader()))["tokens"]
    assert batch.shape == (4, _SEQ + 1) and torch.equal(batch[0], train[0]["tokens"])
    assert next(iter(dm.val_dataloader()))["tokens"].shape == (4, _SEQ + 1)


def test_text_corpus_reuses_its_cache_and_reads_gzip(tmp_path: Path, corpus_docs: list[str]) -> None:
    objects = [{"text": t} for t in corpus_docs]
    plain = _datamodule(_write_jsonl(tmp_path / "c.jsonl", objects))
    plain.setup()  # without prepare_data: setup builds the cache itself
    cache = Path(plain.cache_dir)
    stats = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.iterdir() if p.suffix != ".lock"}
    assert sum(name.endswith(".model") for name in stats) == 1 and sum(n.endswith(".npy") for n in stats) == 3
    again = _datamodule(tmp_path / "c.jsonl")
    again.prepare_data()
    again.setup()
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.iterdir() if p.suffix != ".lock"} == stats
    assert np.array_equal(again.train_dataset.tokens, plain.train_dataset.tokens)  # type: ignore[union-attr]
    # the same documents gzipped, tokenized with the model trained above: identical token arrays
    assert plain.tokenizer is not None
    gz = _datamodule(
        _write_jsonl(tmp_path / "c.jsonl.gz", objects),
        tokenizer_model=plain.tokenizer.model_path,
        vocab_size=12345,
        cache_dir=str(tmp_path / "gzcache"),
    )
    assert gz.vocab_size == 400  # taken from the model as soon as it is given
    gz.prepare_data()
    gz.setup()
    assert np.array_equal(gz.train_dataset.tokens, plain.train_dataset.tokens)  # type: ignore[union-attr]
    assert np.array_equal(gz.val_dataset.tokens, plain.val_dataset.tokens)  # type: ignore[union-attr]


def _setup_in_child(path: str, queue: Any) -> None:
    dm = _datamodule(Path(path))
    dm.setup()
    queue.put((dm.tokenizer.model_path, np.asarray(dm.train_dataset.tokens).tobytes()))  # type: ignore[union-attr]


def test_text_corpus_concurrent_setup_builds_once(tmp_path: Path, corpus_docs: list[str]) -> None:
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_docs])
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_setup_in_child, args=(str(path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    files = os.listdir(tmp_path / ".megatron_lite_cache")
    assert not [f for f in files if f.startswith(".")], files  # no temporary leftovers


def test_text_corpus_errors_name_the_fix(tmp_path: Path, corpus_docs: list[str]) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass data.path="):
        _datamodule(tmp_path / "missing.jsonl")
    empty = _write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match="no non-empty text under key 'text'"):
        _datamodule(empty)
    other_key = _write_jsonl(tmp_path / "content.jsonl", [{"id": 1, "content": "hello"}])
    with pytest.raises(ValueError, match=r"no key 'text' \(its keys: \['content', 'id'\]\); pass data.json_key"):
        _datamodule(other_key)
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": t} for t in corpus_docs])
    for split, message in (
        ("0,100", "leaves the train split empty"),
        ("abc", "not a list of numbers"),
        ("1,2,3,4", "1-3 non-negative"),
        ("90,-10", "1-3 non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            _datamodule(good, split=split)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 260"):
        _datamodule(good, vocab_size=100)
    with pytest.raises(ValueError, match=r"vocab_size 280 is too small for this corpus: it needs at least \d+"):
        _datamodule(good, vocab_size=280).prepare_data()
    with pytest.raises(ValueError, match="change global_batch_size to a multiple of 4"):
        _datamodule(good, micro_batch_size=4, global_batch_size=6)
    dm = _datamodule(good, split="98,2", global_batch_size=8)  # 1 of 20 documents for validation
    with pytest.raises(ValueError, match=r"validation split has \d+ samples.*larger share of split='98,2'"):
        dm.val_dataloader()


def test_split_parsing() -> None:
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("969/30/1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("1") == (1.0, 0.0, 0.0)


def test_text_corpus_in_a_trainer_sets_vocab_before_the_model(tmp_path: Path, corpus_docs: list[str]) -> None:
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_docs])
    dm = _datamodule(path, vocab_size=420)
    seen: list[int] = []

    class Model(_Recorder):
        def configure_model(self) -> None:
            seen.append(self.trainer.datamodule.vocab_size)

    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, dm)
    assert seen == [420]
    assert [b.shape for b in model.batches] == [(4, _SEQ + 1)] * 2
    assert torch.equal(model.batches[1][0], dm.train_dataset[4]["tokens"])  # type: ignore[index]


def test_bundled_corpus() -> None:
    assert bundled_corpus().endswith("shakespeare.jsonl.gz") and os.path.isfile(bundled_corpus())
    with pytest.raises(FileNotFoundError, match="available: \\['shakespeare'\\]"):
        bundled_corpus("nope")


def test_configs_name_a_bundled_corpus_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``path: shakespeare`` resolves inside the installed package whatever the working directory; a file wins."""
    monkeypatch.chdir(tmp_path)  # not the checkout: a path relative to the repository would not exist here
    assert bundled_corpora() == ["shakespeare"]
    assert resolve_corpus("shakespeare") == bundled_corpus("shakespeare")
    dm = TextCorpusDataModule("shakespeare", vocab_size=512, cache_dir=str(tmp_path / "cache"))
    assert dm.path == bundled_corpus("shakespeare")
    local = _write_jsonl(tmp_path / "shakespeare", [{"text": "a local file of that name"}])
    assert resolve_corpus("shakespeare") == "shakespeare" and os.path.samefile("shakespeare", local)
    for missing in ("shakespear", "megatron_lite/data/corpora/shakespeare.jsonl.gz"):
        with pytest.raises(
            FileNotFoundError,
            match=rf"^corpus {missing} does not exist; pass data.path=<a .jsonl or "
            rf"\.jsonl\.gz file> or the name of a bundled corpus: shakespeare$",
        ):
            TextCorpusDataModule(missing, vocab_size=512, cache_dir=str(tmp_path / "cache"))
