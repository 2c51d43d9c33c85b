"""A notebook's session, as a notebook runs it: one process, the fork launcher, fit -> validate -> predict ->
generate -> save -> fit again, at devices=1, TP2 and DP2. The ranks hand the trained model back, so every
later call uses the trained weights (issue 9, item 0); the numbers are checked against a run without
any launcher in this process and against what the ranks computed."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import megatron_lite as ml
from megatron_lite.core.parallel.schedules import gpt_loss
from megatron_lite.data import MockGPTDataModule

# vocab 128 with make_vocab_size_divisible_by=128: padded to 128 rows at TP1 and 256 at TP2, which must not
# change the model (the padding is masked and never handed back), so the numbers compare across layouts.
CONFIG = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16, make_vocab_size_divisible_by=128
)
OPTIMIZER = dict(lr=2e-2, lr_warmup_iters=0, lr_decay_style="constant")
STEPS = 6
GBS = 4


def _data() -> MockGPTDataModule:
    return MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=GBS, vocab_size=128, seed=3, num_val_samples=8
    )


def _module() -> ml.GPTModule:
    return ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(**OPTIMIZER), seed=1)


class TrainLosses(L.Callback):
    """Rank 0's loss of every step, written to a file (the callback runs in the forked ranks)."""

    def __init__(self, path: Path) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.losses))


def _trainer(tp: int, devices: int, pp: int = 1, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, start_method="fork"
        ),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _fit_kwargs(steps: int) -> dict:
    # Validation once, at the end of fit: its val/loss is the one to compare.
    return dict(max_steps=steps, val_check_interval=steps, limit_val_batches=2)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The same training in this process without MegatronStrategy or any launcher."""
    module = _module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **_fit_kwargs(STEPS),
    )
    trainer.fit(module, _data())
    return {"val_loss": float(trainer.callback_metrics["val/loss"])}


def _first_batch_loss(model: torch.nn.Module) -> float:
    """The model's per-token loss on the first training batch (what step 0 of a fit logs)."""
    dataset = _data().train_dataset
    tokens = torch.stack([dataset[i]["tokens"] for i in range(GBS)])
    with torch.no_grad():
        total, count = gpt_loss(model.eval(), {"tokens": tokens})
    return float(total / count)


@pytest.mark.parametrize(
    "tp,pp,devices", [(1, 1, 1), (2, 1, 2), (1, 1, 2), (1, 2, 2)], ids=["devices1", "tp2", "dp2", "pp2"]
)
def test_notebook_session_uses_the_trained_model(tp, pp, devices, reference, tmp_path):
    module, data = _module(), _data()
    fresh_first_loss = _first_batch_loss(_module().build_model(ml.ParallelLayout.single()))

    # fit: the trained model, its metrics and its step come back to this process
    trainer = _trainer(tp, devices, pp, **_fit_kwargs(STEPS))
    frozen_before = gc.get_freeze_count()
    trainer.fit(module, data)
    # the launcher froze this process's heap for the fork only: the notebook's garbage is collected again after
    assert gc.get_freeze_count() == frozen_before
    fit_val = float(trainer.callback_metrics["val/loss"])
    assert trainer.global_step == STEPS
    assert module.model is not None and module.model.layout.world_size == 1  # a one-process model
    # The same training as one process without any launcher (fp32 tolerance across layouts).
    assert fit_val == pytest.approx(reference["val_loss"], rel=1e-5)

    # validate (new ranks, the handed-back weights cut into this layout's shards): the val/loss of fit
    validated = trainer.validate(module, data, verbose=False)[0]["val/loss"]
    assert validated == pytest.approx(fit_val, rel=1e-6)
    fresh = _trainer(tp, devices, pp, limit_val_batches=2).validate(_module(), data, verbose=False)[0]["val/loss"]
    assert abs(fresh - validated) > 0.05, "validate scored an untrained model"

    # predict: every sample once, in the dataset's order, batched as the loader batches (5 samples over
    # DP2 give the ranks 3 and 2), equal to this process's trained model
    samples = [{"tokens": (torch.arange(16) * (i + 1)) % 128} for i in range(5)]
    predictions = _trainer(tp, devices, pp).predict(module, DataLoader(samples, batch_size=2))
    assert [p.shape[0] for p in predictions] == [2, 2, 1]
    tokens = torch.stack([s["tokens"] for s in samples])
    local = module.model.eval().full_logits(tokens)
    torch.testing.assert_close(torch.cat(predictions), local, rtol=1e-5, atol=1e-5)

    # generate here with the trained weights: the first new token is the predicted argmax
    generated = module.generate(tokens[:1, :13].tolist(), max_new_tokens=3).tokens[0]  # 13 + 3 = the context
    assert len(generated) == 3
    assert generated[0] == int(predictions[0][0, 12].argmax())

    # save here, load into a fresh module in new ranks: the trained weights
    trainer.save_checkpoint(tmp_path / "notebook.ckpt")
    restored = _trainer(tp, devices, pp, limit_val_batches=2).validate(
        _module(), data, ckpt_path=str(tmp_path / "notebook.ckpt"), verbose=False
    )[0]["val/loss"]
    assert restored == pytest.approx(fit_val, rel=1e-6)

    # fit again: the new ranks start from the trained weights (step 0's loss is theirs, not a fresh model's)
    trained_first_loss = _first_batch_loss(module.model)
    losses = tmp_path / "losses.json"
    _trainer(tp, devices, pp, max_steps=2, limit_val_batches=0, callbacks=[TrainLosses(losses)]).fit(module, data)
    second_fit = json.loads(losses.read_text())
    assert second_fit[0] == pytest.approx(trained_first_loss, rel=1e-5)
    assert abs(second_fit[0] - fresh_first_loss) > 0.05


class BuiltInConfigureModel(ml.GPTModule):
    """A module with no way to take full weights in the launching process (as a user's own
    LightningModule that builds its model in configure_model would be)."""

    load_full_state_dict = None  # type: ignore[assignment]


def test_refuses_what_it_cannot_hand_back():
    module, data = BuiltInConfigureModel(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(**OPTIMIZER)), _data()
    trainer = _trainer(1, 2, max_steps=2, limit_val_batches=0)
    with pytest.warns(UserWarning, match="could not be handed back"):
        trainer.fit(module, data)
    with pytest.raises(RuntimeError, match="could not be handed back.*load_full_state_dict"):
        trainer.validate(module, data)


def test_one_trainer_keeps_its_logger_version_the_environment_and_eval_mode_inference(tmp_path, monkeypatch):
    """Issue 21, items 5 and 14(b, c): after a forked fit the model comes back in train mode, yet full_logits runs
    without dropout (equal calls, equal to eval mode) and leaves the mode as it was; fit and two validates of one
    Trainer log into one version (as without fork); the launcher's MASTER_PORT & co. do not stay in this process."""
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.delenv("MASTER_PORT", raising=False)
    environment = dict(os.environ)
    module = ml.GPTModule(ml.GPTConfig(**CONFIG, hidden_dropout=0.5), ml.OptimizerConfig(**OPTIMIZER), seed=1)
    trainer = L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_steps=2,
        limit_val_batches=1,
    )
    trainer.fit(module, _data())
    trainer.validate(module, _data(), verbose=False)
    trainer.validate(module, _data(), verbose=False)
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    assert dict(os.environ) == environment

    tokens = torch.arange(32).reshape(2, 16) % 128
    assert module.model.training
    first, second = module.full_logits(tokens), module.full_logits(tokens)
    assert module.model.training  # left as it was
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(first, module.model.eval().full_logits(tokens), rtol=0, atol=0)


def test_extensions_added_by_callbacks_come_back_with_their_trained_values(tmp_path):
    """Issue 21(e): TrainDraftHead adds its extension in `setup`, which runs in the forked ranks only; the module
    handed back to this process still holds the head the ranks trained (the file the rank wrote at the end of fit
    loads onto this process's model and equals it)."""
    from megatron_lite.callbacks import TrainDraftHead
    from megatron_lite.post_training.speculative import draft_head_of, load_draft_head

    module, head_file = _module(), tmp_path / "head.safetensors"
    trainer = _trainer(1, 1, max_steps=2, limit_val_batches=0, callbacks=[TrainDraftHead(save_path=head_file)])
    trainer.fit(module, _data())
    head = draft_head_of(module.model)
    assert head is not None
    trained = load_draft_head(head_file, module.model)  # also checks that the base handed back is the ranks'
    for (name, ours), (_, theirs) in zip(head.state_dict().items(), trained.state_dict().items()):
        assert torch.equal(ours, theirs), name
