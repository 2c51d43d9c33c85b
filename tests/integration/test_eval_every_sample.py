"""Evaluation covers every sample of its split: the last global batch is padded with masked-out samples, so
val/loss is the mean over every loss token of the split at any global batch size and data-parallel size."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule, MockGPTDataset, PreferenceDataModule
from megatron_lite.data.indexed_dataset import write_dataset
from megatron_lite.data.pretrain import PretrainDataModule
from megatron_lite.data.sft import SFTDataModule
from megatron_lite.data.text_corpus import TextCorpusDataModule
from megatron_lite.tokenizers import GPT2BPETokenizer, NullTokenizer

REPO = Path(__file__).resolve().parents[2]
CONFIG = dict(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    seq_length=16,
    make_vocab_size_divisible_by=8,
)
VAL_SAMPLES, SEED = 13, 7  # 13 = 3 x 4 + 1 = 8 + 5: no global batch size used here divides it


def _validate(gbs: int, devices: int) -> float:
    data = MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=gbs, vocab_size=200, seed=SEED, num_val_samples=VAL_SAMPLES
    )
    trainer = L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (result,) = trainer.validate(ml.GPTModule(ml.GPTConfig(**CONFIG), seed=1234), data)
    return result["val/loss"]


def test_val_loss_is_the_mean_over_every_sample_at_any_batch_size_and_dp() -> None:
    model = ml.GPTModel(ml.GPTConfig(**CONFIG), seed=1234)  # the module's weights (same seed)
    split = MockGPTDataset(VAL_SAMPLES, 16, 200, seed=SEED + 1)  # the mock data's validation split
    tokens = torch.stack([split[i]["tokens"] for i in range(VAL_SAMPLES)])
    with torch.no_grad():
        by_hand = float(model(tokens[:, :-1], tokens[:, 1:]).mean())
    losses = {(gbs, dp): _validate(gbs, dp) for gbs, dp in ((4, 1), (8, 1), (8, 2))}
    for layout, loss in losses.items():
        assert loss == pytest.approx(by_hand, rel=1e-6, abs=0), (layout, losses, by_hand)


def _rows(dm) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, loss_mask) of every validation batch of ``dm``, in order (one process: the global batches)."""
    batches = list(dm.val_dataloader())
    assert all(len(b["tokens"]) == dm.global_batch_size for b in batches)  # whole global batches only
    return torch.cat([b["tokens"] for b in batches]), torch.cat([b["loss_mask"] for b in batches])


def _assert_every_sample_once(dm, split) -> None:
    """Every sample of ``split`` once, in order, with its own loss mask; then padding that counts no token."""
    tokens, masks = _rows(dm)
    n = len(split)
    assert n % dm.global_batch_size and len(tokens) == n - n % dm.global_batch_size + dm.global_batch_size
    assert torch.equal(tokens[:n], torch.stack([split[i]["tokens"] for i in range(n)]))
    own = [split[i].get("loss_mask", torch.ones(dm.seq_length)) for i in range(n)]
    assert torch.equal(masks[:n], torch.stack(own).to(masks.dtype))
    assert masks[n:].sum() == 0  # the padding adds no loss token


def test_every_datamodule_pads_its_evaluation_splits(tmp_path: Path) -> None:
    mock = MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=200, seed=SEED, num_val_samples=VAL_SAMPLES
    )
    _assert_every_sample_once(mock, mock.val_dataset)

    rng = np.random.default_rng(0)
    write_dataset(
        str(tmp_path / "bin"),
        [[rng.integers(1, 90, size=int(rng.integers(4, 40)))] for _ in range(60)],
        dtype=np.uint16,
    )
    tokenizer = NullTokenizer(96)
    pretrain = PretrainDataModule(
        str(tmp_path / "bin"),
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=8,
        split="50,50",
        tokenizer=tokenizer,
        eod_mask_loss=True,
        cache_dir=str(tmp_path / "cache"),
    )
    _assert_every_sample_once(pretrain, pretrain._dataset("validation"))

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i}: " + "words " * (5 + i % 9)}) + "\n" for i in range(80))
    )
    text = TextCorpusDataModule(
        str(corpus),
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=8,
        split="50,50",
        tokenizer_model=str(REPO / "tests/data/tokenizers/llama-sp/tokenizer.model"),
        cache_dir=str(tmp_path / "cache"),
    )
    text.setup()
    _assert_every_sample_once(text, text.val_dataset)

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"{i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
            )
            + "\n"
            for i in range(60)
        )
    )
    gpt2 = REPO / "tests/data/tokenizers/gpt2"
    tokenizer = GPT2BPETokenizer(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt"))
    sft = SFTDataModule(str(chats), tokenizer, seq_length=32, micro_batch_size=2, global_batch_size=8, split="50,50")
    sft.setup()
    _assert_every_sample_once(sft, sft.datasets["validation"])


def test_preference_data_says_which_pairs_it_leaves_out(tmp_path: Path) -> None:
    """Preference pairs cannot be masked out of a DPO or reward loss by a loss_mask: the split's last partial
    global batch is left out, and a warning says so (naming the fix) instead of a silently different metric."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i} 1", "chosen": "2 3", "rejected": "4"}) + "\n" for i in range(26))
    )
    dm = PreferenceDataModule(
        str(pairs), NullTokenizer(64), seq_length=8, micro_batch_size=2, global_batch_size=4, split="50,50"
    )
    with pytest.warns(
        UserWarning,
        match=r"the last 1 of the 13 samples of the validation split are not evaluated"
        r".*multiple of global_batch_size \(4\)",
    ):
        batches = list(dm.val_dataloader())
    assert sum(len(b["index"]) for b in batches) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a split of whole global batches: nothing left out, nothing said
        PreferenceDataModule(
            str(pairs), NullTokenizer(64), seq_length=8, micro_batch_size=2, global_batch_size=4, split="14,12"
        ).val_dataloader()
