"""The same seed is the same model at any TP size, whatever the vocabulary padding.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x tp``: with
``vocab_size=128`` and ``make_vocab_size_divisible_by=128`` that is 128 rows at TP1, 256 at TP2 and 512
at TP4 (TP ranks 1-3 then hold nothing but padding). Through a real Trainer: 10 steps of losses, the first
step's gradients (real rows: gradients and parameters are gathered without the padding) and the final
parameters equal the TP1 run at fp32 tolerance; checkpoints hold the real 128 rows, so one saved at TP2
resumes at TP1 and one saved at TP1 resumes at TP2 with the distributed optimizer, continuing the
uninterrupted run; greedy generation at TP2 equals TP1's and never emits a padding id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import assert_same_training, run, tiny_config
from spawn_utils import run_ranks

import megatron_lite as ml
from megatron_lite.core.inference import generate

CONFIG = tiny_config(vocab_size=128, make_vocab_size_divisible_by=128)
VOCAB_PARAMS = ("embedding.weight", "output_layer.weight")


def _greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of every row of ``prompt`` (the rows have equal lengths, so equal outputs)."""
    return torch.tensor(generate(model, prompt.tolist(), max_new_tokens).tokens)


def optimizer(**kwargs) -> ml.OptimizerConfig:
    return ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, **kwargs)


def _run_saving_at_step_5(out: Path, **kwargs) -> dict:
    result = run(
        out,
        config=CONFIG,
        optimizer=optimizer(),
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=5, save_top_k=-1)],
        **kwargs,
    )
    result["checkpoint"] = str(out / "ckpts" / "epoch=0-step=5.ckpt")
    return result


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return _run_saving_at_step_5(tmp_path_factory.mktemp("tp1"), devices=1)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _run_saving_at_step_5(tmp_path_factory.mktemp("tp2"), devices=2, tp=2)


def _assert_same_model(result: dict, reference: dict) -> None:
    for name in VOCAB_PARAMS:
        assert result["params"][name].shape == (CONFIG.vocab_size, CONFIG.hidden_size), name
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


def test_tp2_pads_differently_and_trains_the_same_model(tp1, tp2):
    assert CONFIG.padded_vocab_size(1) == 128 and CONFIG.padded_vocab_size(2) == 256
    _assert_same_model(tp2, tp1)


def test_tp4_with_ranks_holding_only_padding_trains_the_same_model(tp1, tmp_path):
    assert CONFIG.padded_vocab_size(4) == 512  # 128 rows per rank: rank 0 holds every real one
    _assert_same_model(run(tmp_path, devices=4, tp=4, config=CONFIG, optimizer=optimizer()), tp1)


def test_odd_vocabulary_split_unevenly_over_tp2_trains_the_same_model(tmp_path):
    # 1001 tokens: 1100 rows at TP1, 1200 at TP2 (600 real rows on rank 0, 401 and 199 of padding on rank 1)
    config = tiny_config(vocab_size=1001, make_vocab_size_divisible_by=100)
    assert (config.padded_vocab_size(1), config.padded_vocab_size(2)) == (1100, 1200)
    single = run(tmp_path / "tp1", devices=1, config=config, optimizer=optimizer(), steps=4)
    tp2 = run(tmp_path / "tp2", devices=2, tp=2, config=config, optimizer=optimizer(), steps=4)
    assert tp2["params"]["embedding.weight"].shape == (1001, config.hidden_size)
    assert_same_training(tp2, single)


def _vocab_entries(checkpoint: str) -> dict[str, tuple]:
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {
        key: tuple(md.size)
        for key, md in metadata.items()
        if any(name in key for name in VOCAB_PARAMS) and len(getattr(md, "size", ())) > 0
    }


def test_checkpoint_saved_at_tp2_holds_the_real_rows_and_resumes_at_tp1(tp1, tp2, tmp_path):
    entries = _vocab_entries(tp2["checkpoint"])
    # the weights and Adam's two moments of both vocabulary tensors
    assert len(entries) == 6 and set(entries.values()) == {(128, CONFIG.hidden_size)}, entries
    resumed = run(tmp_path, devices=1, config=CONFIG, optimizer=optimizer(), ckpt_path=tp2["checkpoint"])
    assert resumed["global_step"] == 10
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(tp1["losses"][5:]), rtol=1e-5, atol=0)
    assert_same_training(resumed, tp1 | {"losses": tp1["losses"][5:]}, grads=False)


def test_checkpoint_saved_at_tp1_resumes_at_tp2_with_the_distributed_optimizer(tp1, tmp_path):
    """TP2 x DP2 with ZeRO-1: Adam's moments of the 128 saved rows land in DP shards of 256-row tensors."""
    resumed = run(
        tmp_path,
        devices=4,
        tp=2,
        config=CONFIG,
        ckpt_path=tp1["checkpoint"],
        optimizer=optimizer(use_distributed_optimizer=True),
    )
    assert resumed["global_step"] == 10
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(tp1["losses"][5:]), rtol=1e-5, atol=0)
    assert_same_training(resumed, tp1 | {"losses": tp1["losses"][5:]}, grads=False)


def test_bf16_masters_are_saved_with_the_real_rows_and_load_at_another_padding(tmp_path):
    """bf16 weights keep fp32 masters: saved at TP2 (256 padded rows) as 128 rows, resumed at TP1 (128)."""
    saved = run(
        tmp_path / "tp2",
        devices=2,
        tp=2,
        config=CONFIG,
        optimizer=optimizer(),
        steps=5,
        precision="bf16-true",
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)],
    )
    checkpoint = str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt")
    entries = _vocab_entries(checkpoint)
    masters = {k: v for k, v in entries.items() if k.endswith(".master")}
    assert len(masters) == 2 and set(entries.values()) == {(128, CONFIG.hidden_size)}, entries
    resumed = run(
        tmp_path / "tp1",
        devices=1,
        config=CONFIG,
        optimizer=optimizer(),
        steps=5,
        precision="bf16-true",
        ckpt_path=checkpoint,
    )
    # bf16 products differ between TP1 and TP2 in the last bits: bf16-level agreement
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(saved["losses"][3:]), rtol=5e-3, atol=0)


PROMPT = torch.tensor([[5, 17, 42], [7, 7, 7]])


def _generation_config(vocab_size: int, divisible_by: int) -> ml.GPTConfig:
    return ml.GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=vocab_size,
        seq_length=16,
        make_vocab_size_divisible_by=divisible_by,
    )


def _generate(rank, world_size, vocab_size, divisible_by):
    config = _generation_config(vocab_size, divisible_by)
    model = ml.GPTModel(config, ml.ParallelLayout.build(ml.ParallelConfig(tensor_model_parallel_size=2)), seed=3)
    logits = model(PROMPT)  # this rank's slice of the padded vocabulary
    padding = logits[..., max(0, config.vocab_size - model.vocab_start) :]
    return {
        "tokens": _greedy(model, PROMPT, 13),
        "full_logits": model.full_logits(PROMPT),
        "padding_is_masked": bool(torch.isneginf(padding).all()),
        "padded": model.padded_vocab_size,
    }


@pytest.mark.parametrize(
    "vocab_size,divisible_by,padded",
    [(128, 128, 256), (1001, 100, 1200)],
    ids=["rank1_only_padding", "uneven_real_rows"],
)
def test_greedy_generation_at_tp2_equals_tp1_and_never_emits_padding(vocab_size, divisible_by, padded):
    config = _generation_config(vocab_size, divisible_by)
    single_model = ml.GPTModel(config, seed=3)
    single = _greedy(single_model, PROMPT, 13)
    single_logits = single_model.full_logits(PROMPT)
    for rank, out in enumerate(run_ranks(_generate, 2, vocab_size, divisible_by)):
        assert out["padded"] == padded
        assert torch.equal(out["tokens"], single), rank
        assert out["padding_is_masked"], rank
        assert out["full_logits"].shape == (2, 3, vocab_size) and out["full_logits"].is_contiguous()
        assert out["full_logits"].untyped_storage().nbytes() == out["full_logits"].numel() * 4
        torch.testing.assert_close(out["full_logits"], single_logits, rtol=1e-5, atol=1e-6)
    assert int(single.max()) < vocab_size
