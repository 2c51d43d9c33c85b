"""Distill's bad input fails at once with an error naming the fix (before any rank starts under
MegatronStrategy), and ``teacher="self"`` (quantization-aware distillation) takes its copy of the student before
another extension changes the model, whatever the callbacks' order: the teacher keeps the original weights."""

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.callbacks import Distill
from megatron_lite.core.engine.extensions import ObjectiveExtension
from megatron_lite.data import MockGPTDataModule

STUDENT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)


def _teacher(**overrides):
    module = ml.GPTModule(ml.GPTConfig(**{**STUDENT, "num_layers": 3, **overrides}))
    module.configure_model()
    return module


def _fit(student, callbacks, devices=1, steps=2, **strategy):
    # one device runs in this process (the callbacks keep what they saw); more are forked ranks
    launch = dict(strategy=ml.MegatronStrategy(start_method="fork", **strategy)) if devices > 1 else {}
    trainer = L.Trainer(
        **launch,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(
        student, MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3)
    )
    return trainer


TP2, PP2, FSDP2 = dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2), dict(use_torch_fsdp2=True)


@pytest.mark.parametrize(
    "layout, make, message",
    [
        (
            TP2,
            lambda: Distill(_teacher(vocab_size=256)),
            r"teacher's vocabulary \(256 tokens\) differs from the student's \(128\)",
        ),
        (
            TP2,
            lambda: Distill(_teacher(), intermediate_layer_pairs=[("layers.5", "layers.1")]),
            r"'layers.5' is not a module of the student \(2 layers\); valid names: layers.0, layers.1, final_layernorm",
        ),
        (
            TP2,
            lambda: Distill(_teacher(), intermediate_layer_pairs=[("layers.1", "decoder.layers.3")]),
            r"'layers.3' is not a module of the teacher \(3 layers\); valid names: layers.0, layers.1, layers.2",
        ),
        (
            PP2,
            lambda: Distill(_teacher(), intermediate_layer_pairs=[("layers.1", "layers.2")]),
            r"intermediate_layer_pairs under pipeline parallelism is not supported",
        ),
        (FSDP2, lambda: Distill("self"), r"Distill\(teacher='self'\) with use_torch_fsdp2=True"),
    ],
)
def test_bad_teacher_or_layer_is_refused_before_the_ranks_start(layout, make, message):
    student = ml.GPTModule(ml.GPTConfig(**STUDENT))
    with pytest.raises(ValueError, match=message):
        _fit(student, [make()], devices=2, **layout)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(teacher="self", temperature=0.0), "temperature must be a finite number > 0"),
        (dict(teacher="self", intermediate_loss="kl"), r"intermediate_loss must be one of \('cosine', 'mse'\)"),
        (dict(teacher="self", intermediate_layer_pairs=["layers.1"]), r"\(student_module, teacher_module\) name pairs"),
        (dict(teacher="self", skip_lm_loss=True, kd_loss_scale=0.0), "leaves nothing to train on"),
        (dict(teacher="/nonexistent/teacher"), "does not exist: pass one of our checkpoints"),
        (dict(teacher=3), "teacher must be a checkpoint/HF directory path, a GPTModule or 'self'"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message):
        Distill(**kwargs)


class Coarsen(ObjectiveExtension):
    """Stands in for fake quantization: rounds every weight in place when it attaches."""

    def attach(self, module, model, layout):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_((p * 8).round() / 8)


class AddCoarsen(L.Callback):
    def setup(self, trainer, pl_module, stage):
        pl_module.add_objective_extension(Coarsen())


class KDLoss(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/kd_loss"]))


def test_self_teacher_is_copied_before_other_extensions_change_the_model():
    distill, kd = Distill("self", temperature=2.0, skip_lm_loss=True), KDLoss()
    plain = ml.GPTModule(ml.GPTConfig(**STUDENT))
    plain.configure_model()
    original = {k: v.clone() for k, v in plain.model.state_dict().items()}
    student = ml.GPTModule(ml.GPTConfig(**STUDENT))  # the same seed: built in fit with the same weights
    _fit(student, [AddCoarsen(), distill, kd])  # the "quantizer" is listed first
    teacher = distill.extension.teacher
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, original[name]), f"the teacher's {name} is not the unchanged student's"
    assert not any(p.requires_grad for p in teacher.parameters())
    assert kd.values[0] > 0  # the coarsened student differs from its original self from the first step


def test_self_teacher_equals_the_student_at_first():
    kd = KDLoss()
    _fit(ml.GPTModule(ml.GPTConfig(**STUDENT)), [Distill("self", temperature=2.0), kd], steps=2)
    assert kd.values[0] == pytest.approx(0.0, abs=1e-6) and kd.values[1] > 1e-6
