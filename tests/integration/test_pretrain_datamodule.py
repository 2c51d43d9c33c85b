"""PretrainDataModule end to end: GPTModule under MegatronStrategy on .bin/.idx data, exact resume (also to a
different DP size), blending and the split in a Trainer, and bad input rejected before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.data.indexed_dataset import IndexedDataset, write_dataset
from megatron_lite.data.pretrain import PretrainDataModule

SEQ, VOCAB, GBS, MBS = 16, 96, 8, 2


def _corpus(prefix: Path, num_docs: int, seed: int, low: int = 1, high: int = VOCAB) -> str:
    """``num_docs`` one-sequence documents of 4-40 random tokens in ``[low, high)``."""
    rng = np.random.default_rng(seed)
    write_dataset(
        str(prefix),
        [[rng.integers(low, high, size=int(rng.integers(4, 40)))] for _ in range(num_docs)],
        dtype=np.uint16,
    )
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrain")
    # two corpora whose token ranges do not overlap, so every sample tells which one it came from
    return {
        "a": _corpus(root / "a", 40, 0, 1, 48),
        "b": _corpus(root / "b", 30, 1, 48, VOCAB),
        "cache": str(root / "cache"),
    }


class BatchRecorder(L.Callback):
    """Writes every training batch this rank saw, by optimizer step, to ``rank{global_rank}.pt`` at the end."""

    def __init__(self, out: Path) -> None:
        self.out, self.batches = out, {}  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        self.batches[trainer.global_step] = batch["tokens"].clone()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.batches, self.out / f"rank{trainer.global_rank}.pt")


def _fit(
    out: Path,
    dm: PretrainDataModule,
    devices: int,
    steps: int,
    ckpt_path: str | None = None,
    callbacks: list[L.Callback] | None = None,
) -> dict[int, torch.Tensor]:
    """Fit a tiny GPT under MegatronStrategy (forked ranks, DP = devices); return the global batch per step."""
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB, seq_length=SEQ)
    trainer = L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        callbacks=[BatchRecorder(out), *(callbacks or [])],
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=1)), dm, ckpt_path=ckpt_path)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(devices)]
    # DP ranks hold consecutive slices of each global batch
    return {step: torch.cat([r[step] for r in ranks]) for step in ranks[0]}


def _datamodule(data: dict[str, str], **kwargs: Any) -> PretrainDataModule:
    args: dict[str, Any] = dict(
        paths=["0.6", data["a"], "0.4", data["b"]],
        seq_length=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        split="75,25",
        seed=5,
        cache_dir=data["cache"],
        train_samples=40,
    )  # 5 steps per pass: runs cross Lightning epochs
    args.update(kwargs)
    return PretrainDataModule(**args)


def test_resume_is_exact_also_after_a_dp_change(tmp_path: Path, data: dict[str, str]) -> None:
    ckpts = tmp_path / "ckpts"
    dm = _datamodule(data)
    full = _fit(
        tmp_path / "full",
        dm,
        devices=2,
        steps=8,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=6, save_top_k=-1)],
    )
    assert sorted(full) == list(range(8)) and all(b.shape == (GBS, SEQ + 1) for b in full.values())
    assert torch.equal(full[5], full[0])  # the second pass over the 40 samples repeats the first
    saved = ckpts / "epoch=1-step=6.ckpt"
    meta = read_checkpoint_meta(saved)
    assert meta["PretrainDataModule"] == {
        "consumed_samples": 48,
        "sampler": "sequential",
        "data_sharding": True,
        "data_parallel_size": 2,
    }
    # the blend: the 40 samples hold 24 from a (tokens < 48) and 16 from b, interleaved by weight
    dm.setup("fit")  # in this process too (the ranks were forked), to read the blend's indices
    blend = [int(sample[0] >= 48) for step in range(5) for sample in full[step]]
    assert blend == dm.train_dataset.dataset_index.tolist() and sum(blend) == 16  # type: ignore[union-attr]
    same_dp = _fit(tmp_path / "same_dp", _datamodule(data), devices=2, steps=8, ckpt_path=str(saved))
    assert sorted(same_dp) == [6, 7] and all(torch.equal(same_dp[s], full[s]) for s in (6, 7))
    one_rank = _fit(tmp_path / "one_rank", _datamodule(data), devices=1, steps=8, ckpt_path=str(saved))
    assert sorted(one_rank) == [6, 7] and all(torch.equal(one_rank[s], full[s]) for s in (6, 7))


def test_cyclic_sampler_in_a_trainer(tmp_path: Path, data: dict[str, str]) -> None:
    dm = _datamodule(data, paths=[data["a"]], sampler="cyclic", data_sharding=False)
    batches = _fit(tmp_path / "cyclic", dm, devices=2, steps=3)
    dm.setup("fit")  # the ranks were forked: this process has not built the datasets (train_samples fixes them)
    dataset = dm.train_dataset
    assert dataset is not None and len(batches) == 3
    seen = torch.cat(list(batches.values()))
    sequential = torch.stack([dataset[i]["tokens"] for i in range(len(seen))])
    assert not torch.equal(seen, sequential)  # shuffled ...
    every = {tuple(dataset[i]["tokens"].tolist()) for i in range(len(dataset))}
    assert len({tuple(t.tolist()) for t in seen}) == len(seen) and all(tuple(t.tolist()) in every for t in seen)


def test_split_vocab_and_loaders_without_a_trainer(tmp_path: Path, data: dict[str, str]) -> None:
    dm = PretrainDataModule(
        [data["a"]],
        seq_length=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        split="969,30,1",
        cache_dir=data["cache"],
    )
    assert dm.vocab_size == int(max(IndexedDataset(data["a"])[i].max() for i in range(40))) + 1  # scanned
    assert dm.weights == [1.0] and dm.prefixes == [data["a"]]
    dm.setup("fit")
    train = dm.train_dataset
    assert train is not None and set(train.indices.tolist()) == set(range(39))  # 969,30,1 of 40 documents
    with pytest.raises(ValueError, match=rf"the test split of {data['a']} is empty .*limit_test_batches=0"):
        dm.test_dataloader()
    # a validation split smaller than one global batch is padded to one, the padding masked out of the loss
    val = dm._dataset("validation")
    (batch,) = list(dm.val_dataloader())
    real = len(val)  # type: ignore[arg-type]
    assert 0 < real < GBS and batch["tokens"].shape == (GBS, SEQ + 1)
    assert torch.equal(batch["tokens"][0], val[0]["tokens"])
    assert batch["loss_mask"][:real].eq(1).all() and batch["loss_mask"][real:].eq(0).all()
    batch = next(iter(dm.train_dataloader()))["tokens"]
    assert batch.shape == (GBS, SEQ + 1) and torch.equal(batch[1], train[1]["tokens"])
    # unweighted paths are weighted by their tokens; an explicit vocab_size or a tokenizer skips the scan
    both = PretrainDataModule(
        [data["a"], data["b"]], seq_length=SEQ, micro_batch_size=MBS, global_batch_size=GBS, vocab_size=VOCAB + 4
    )
    tokens = [IndexedDataset(p).num_tokens for p in (data["a"], data["b"])]
    assert both.weights == pytest.approx([t / sum(tokens) for t in tokens]) and both.vocab_size == VOCAB + 4
    tokenizer = type("Tok", (), {"vocab_size": 300, "eod": 0})()
    assert PretrainDataModule(data["a"], SEQ, MBS, GBS, tokenizer=tokenizer).vocab_size == 300


def test_bad_input_names_the_file_and_the_fix(tmp_path: Path, data: dict[str, str]) -> None:
    def make(paths: Any, **kwargs: Any) -> PretrainDataModule:
        return PretrainDataModule(paths, seq_length=SEQ, micro_batch_size=MBS, global_batch_size=GBS, **kwargs)

    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=rf"{missing}.idx does not exist.*megatron-lite preprocess"):
        make([missing])
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"half.bin does not exist"):
        make([str(tmp_path / "half")])
    with pytest.raises(ValueError, match=rf"the weight of {data['b']} is 0.0; every weight must be a positive"):
        make(["1", data["a"], "0", data["b"]])
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        make(["1", data["a"], data["b"]])
    tiny = _corpus(tmp_path / "tiny", 3, 2)
    with pytest.raises(
        ValueError,
        match=rf"split '1,99' leaves the train split of {tiny} with 0 of its 3 "
        r"documents; raise the train weight",
    ):
        make([tiny], split="1,99")
    with pytest.raises(ValueError, match="leaves the train split empty"):
        make([tiny], split="0,1")
    with pytest.raises(ValueError, match="sampler must be one of"):
        make([tiny], sampler="random")
    with pytest.raises(ValueError, match="contradicts the tokenizer's vocabulary of 300; drop vocab_size"):
        make([tiny], tokenizer=type("Tok", (), {"vocab_size": 300})(), vocab_size=200)
    with pytest.raises(ValueError, match="eod_mask_loss=True needs the tokenizer"):
        make([tiny], eod_mask_loss=True)
    with pytest.raises(ValueError, match="change global_batch_size to a multiple of 2"):
        PretrainDataModule([tiny], seq_length=SEQ, micro_batch_size=2, global_batch_size=5)
