"""Objective extensions change what a module optimises through the one training step: an extension that
doubles the loss gives exactly twice the plain run's losses (and, with SGD, the same trajectory as a
doubled learning rate), extensions nest first-outermost, attach once per built model, and their step
metrics are logged."""

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.core.engine.extensions import ExtendedObjective, ObjectiveExtension
from megatron_lite.data import MockGPTDataModule

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)


class Scale(ObjectiveExtension):
    def __init__(self, factor):
        self.factor, self.attached, self.last = factor, [], None

    def attach(self, module, model, layout):
        self.attached.append(id(model))

    def loss(self, inner, output, microbatch):
        total, count = inner(output, microbatch)
        self.last = total.detach() / count
        return total * self.factor, count

    def step_metrics(self):
        return {"train/scaled_by": torch.tensor(float(self.factor))}


class Record(L.Callback):
    def __init__(self):
        self.losses, self.metrics = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.metrics.append(
            float(trainer.callback_metrics["train/scaled_by"])
            if "train/scaled_by" in trainer.callback_metrics
            else None
        )


def fit(extensions, lr):
    record = Record()
    module = ml.GPTModule(
        ml.GPTConfig(**CONFIG),
        ml.OptimizerConfig(optimizer="sgd", lr=lr, weight_decay=0.0, clip_grad=0.0, lr_decay_style="constant"),
    )
    for extension in extensions:
        module.add_objective_extension(extension)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record],
    )
    trainer.fit(
        module, MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3)
    )
    return module, record


def test_an_extension_changes_the_loss_through_the_one_training_step():
    _, plain = fit([], lr=0.2)
    scale = Scale(2.0)
    module, doubled = fit([scale], lr=0.1)
    # SGD on 2·L with lr/2 takes the same steps as on L with lr: the losses are exactly twice the plain run's
    torch.testing.assert_close(torch.tensor(doubled.losses), 2 * torch.tensor(plain.losses), rtol=1e-5, atol=0)
    assert scale.attached == [id(module.model)]  # attached once, to the model the Trainer built
    assert doubled.metrics == [2.0] * 4 and plain.metrics == [None] * 4


def test_extensions_nest_first_added_outermost():
    calls = []

    class Tag(ObjectiveExtension):
        def __init__(self, name):
            self.name = name

        def forward_step(self, inner, part, microbatch, input_tensor):
            calls.append(f"{self.name}>")
            out = inner(part, microbatch, input_tensor)
            calls.append(f"<{self.name}")
            return out

        def loss(self, inner, output, microbatch):
            total, count = inner(output, microbatch)
            return total + (1.0 if self.name == "a" else 10.0) * (calls.append(self.name) or 1), count

    class Base:
        def forward_step(self, part, microbatch, input_tensor):
            calls.append("base")
            return torch.ones(())

        def loss(self, output, microbatch):
            return output, torch.ones(())

    objective = ExtendedObjective(Base(), [Tag("a"), Tag("b")])
    objective.forward_step(None, {}, None)
    assert calls == ["a>", "b>", "base", "<b", "<a"]
    total, _ = objective.loss(torch.zeros(()), {})
    assert float(total) == 11.0 and calls[-2:] == ["b", "a"]  # the inner one (b) adds first


def test_a_model_handed_over_in_eval_mode_trains_in_train_mode():
    """from_pretrained returns the model in eval mode; Lightning keeps a module's mode at fit, so without
    GPTModule.on_train_start a fine-tune would run without dropout and without training-only extension terms."""
    seen = []

    class Mode(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(pl_module.model.training)

    module = ml.GPTModule(ml.GPTConfig(**CONFIG))
    module.configure_model()
    module.model.eval()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        callbacks=[Mode()],
    )
    trainer.fit(
        module, MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3)
    )
    assert seen == [True, True]  # also after the validation between the steps
