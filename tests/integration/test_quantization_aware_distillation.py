"""Quantization-aware distillation (QAD): ``Quantize(when="fit_start")`` and ``Distill("self")`` compose as two
objective extensions of the one training step. Whatever the callbacks' order, the teacher is the unquantized
model as it was built (no quantizers, the original weights, frozen) and the student is the fake-quantized copy
that trains against it: the KD term is non-zero from the first step (zero without the quantizer:
tests/unit/test_distill_bad_input_and_self.py)."""

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.callbacks import Distill, Quantize
from megatron_lite.data import MockGPTDataModule
from megatron_lite.post_training.quantization import is_quantized

CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16)


class KDLoss(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/kd_loss"]))


def test_quantized_student_distils_from_its_unquantized_self():
    original = ml.GPTModule(ml.GPTConfig(**CONFIG))
    original.configure_model()
    weights = {k: v.clone() for k, v in original.model.state_dict().items()}
    student = ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=3e-3, lr_decay_style="constant"))
    distill, kd = Distill("self", skip_lm_loss=True), KDLoss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Quantize("INT4_AWQ_CFG", calib_batches=2, when="fit_start"), distill, kd],
    )
    trainer.fit(
        student, MockGPTDataModule(seq_length=16, micro_batch_size=4, global_batch_size=4, vocab_size=128, seed=3)
    )
    teacher = distill.extension.teacher
    assert is_quantized(student.model) and not is_quantized(teacher)
    assert not any("quantizer" in name for name, _ in teacher.named_modules())
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, weights[name]), f"the teacher's {name} is not the model as built"
    assert not any(p.requires_grad for p in teacher.parameters())
    assert (
        len(kd.values) == 3 and kd.values[0] > 1e-5
    )  # INT4 moves the student from its teacher at once (unquantized: 0 to 1e-6)
