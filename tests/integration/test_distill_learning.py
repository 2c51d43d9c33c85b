"""Distillation teaches: a 2-layer teacher trained 100 steps on the bundled Shakespeare corpus (in the test),
then a 1-layer student half its width trained 60 steps with Distill(teacher) reaches a lower held-out loss
than the same student (same seed, data and steps) trained alone. The teacher is not changed by it, and the
logged parts add up to the loss."""

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.callbacks import Distill
from megatron_lite.data import TextCorpusDataModule

VOCAB = 384  # the smallest byte-fallback vocabulary this corpus allows, rounded up


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("distill_corpus"))


def _data(cache: str) -> TextCorpusDataModule:
    return TextCorpusDataModule(
        "shakespeare", seq_length=32, micro_batch_size=8, global_batch_size=16, vocab_size=VOCAB, cache_dir=cache
    )


def _module(layers: int, hidden: int, seed: int) -> ml.GPTModule:
    config = ml.GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=VOCAB, seq_length=32)
    return ml.GPTModule(config, ml.OptimizerConfig(lr=3e-3, lr_warmup_iters=5, lr_decay_style="constant"), seed=seed)


class Parts(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append([float(outputs["loss"]), float(m["train/lm_loss"]), float(m["train/kd_loss"])])


def _fit(module, cache, steps, callbacks=()):
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
    ).fit(module, _data(cache))


def _held_out(module, cache) -> float:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=8,
    )
    return trainer.validate(module, _data(cache), verbose=False)[0]["val/loss"]


def test_distilled_small_model_beats_the_small_model_trained_alone(cache):
    teacher = _module(2, 64, seed=1)
    _fit(teacher, cache, 100)
    teacher_loss = _held_out(teacher, cache)
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}

    alone = _module(1, 32, seed=2)
    _fit(alone, cache, 60)
    distilled, parts = _module(1, 32, seed=2), Parts()
    _fit(distilled, cache, 60, [Distill(teacher, temperature=1.0, kd_loss_scale=1.0), parts])
    alone_loss, distilled_loss = _held_out(alone, cache), _held_out(distilled, cache)
    print(f"held-out loss: teacher {teacher_loss:.3f}, student alone {alone_loss:.3f}, distilled {distilled_loss:.3f}")

    assert teacher_loss < alone_loss  # the teacher has something to teach
    assert distilled_loss < alone_loss - 0.05
    rows = torch.tensor(parts.rows)
    torch.testing.assert_close(rows[:, 0], rows[:, 1] + rows[:, 2], rtol=1e-5, atol=0)  # loss = lm + 1.0·kd
    assert rows[-1, 2] < rows[0, 2]  # the student moved towards the teacher
    for name, value in teacher.model.state_dict().items():  # frozen: not in the student's optimizer
        assert torch.equal(value, before[name]), name
    assert set(distilled.model.state_dict()) == set(alone.model.state_dict())  # nothing of the teacher's
