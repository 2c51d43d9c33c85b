"""Distillation through a real Trainer is the same run at any layout: with a larger teacher (random weights,
3 layers, wider: intermediate pairs go through a trainable projection), TP2 with sequence parallelism equals
TP1 (per-step losses, the logged lm/kd/intermediate losses, first-step gradients including the projection's,
final parameters; rtol 1e-5), so does CP2 (each rank's zigzag share of the rows through both models), and logits
distillation over 2 pipeline stages (the teacher's activations travel with the student's) equals the one-process run.
The teacher is not in the student's parameters."""

from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

import megatron_lite as ml
from megatron_lite.callbacks import Distill

STUDENT = tiny_config(num_layers=2, seq_length=16, vocab_size=300)
TEACHER = tiny_config(num_layers=4, hidden_size=96, seq_length=16, vocab_size=300)
PAIRS = [("layers.0", "layers.1"), ("decoder.layers.1", "decoder.layers.3")]
METRICS = ("train/lm_loss", "train/kd_loss", "train/intermediate_loss")


class Metrics(L.Callback):
    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append([float(trainer.callback_metrics.get(k, float("nan"))) for k in METRICS])

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.values, self.out / "metrics.pt")


@pytest.fixture(scope="module")
def teacher():
    module = ml.GPTModule(TEACHER, seed=99)
    module.configure_model()
    return module


def _distill(out: Path, teacher, pairs, **layout) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    distill = Distill(
        teacher, temperature=2.0, kd_loss_scale=0.5, intermediate_layer_pairs=pairs, intermediate_loss="mse"
    )
    result = run(out, config=STUDENT, steps=3, gbs=4, mbs=2, callbacks=[distill, Metrics(out)], **layout)
    result["metrics"] = torch.load(out / "metrics.pt")
    return result


@pytest.fixture(scope="module")
def single(teacher, tmp_path_factory):
    return _distill(tmp_path_factory.mktemp("distill_tp1"), teacher, PAIRS)


def test_tp2_sequence_parallel_distillation_equals_tp1(teacher, single, tmp_path):
    tp2 = _distill(tmp_path / "tp2", teacher, PAIRS, devices=2, tp=2, sp=True)
    assert "distill_projections.0.weight" in single["grads"]  # trained with the student
    assert not any(name.startswith("teacher") for name in single["params"])
    lm, kd, intermediate = torch.tensor(single["metrics"]).T
    # the total is the weighted sum of the logged parts (global-batch means)
    torch.testing.assert_close(torch.tensor(single["losses"]), lm + 0.5 * kd + intermediate, rtol=1e-5, atol=0)
    assert (kd > 0).all() and (intermediate > 0).all()
    torch.testing.assert_close(torch.tensor(tp2["metrics"]), torch.tensor(single["metrics"]), rtol=1e-5, atol=0)
    assert_same_training(tp2, single)


def test_context_parallel_distillation_equals_one_process(teacher, single, tmp_path):
    cp2 = _distill(tmp_path / "cp2", teacher, PAIRS, devices=2, strategy_kwargs=dict(context_parallel_size=2))
    torch.testing.assert_close(torch.tensor(cp2["metrics"]), torch.tensor(single["metrics"]), rtol=1e-5, atol=0)
    assert_same_training(cp2, single)


def test_pipeline_parallel_logits_distillation_equals_one_process(teacher, tmp_path):
    single = _distill(tmp_path / "pp1", teacher, [])
    pp2 = _distill(tmp_path / "pp2", teacher, [], devices=2, pp=2)
    torch.testing.assert_close(
        torch.tensor(pp2["metrics"])[:, :2], torch.tensor(single["metrics"])[:, :2], rtol=1e-5, atol=0
    )
    assert_same_training(pp2, single)


def test_an_moe_student_at_ep2_distils_like_one_process(teacher, tmp_path):
    """A dense teacher, an MoE student with its experts over 2 ranks (the teacher is built for the student's layout,
    where EP folds into DP): per-step losses, the logged lm/kd losses, gradients and parameters equal one process's."""
    student = tiny_config(
        num_layers=2,
        seq_length=16,
        vocab_size=300,
        num_moe_experts=4,
        moe_router_topk=2,
        ffn_hidden_size=64,
        moe_aux_loss_coeff=1e-2,
    )

    def distil(out: Path, **layout) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        distill = Distill(teacher, temperature=2.0, kd_loss_scale=0.5)
        result = run(out, config=student, steps=3, gbs=4, mbs=2, callbacks=[distill, Metrics(out)], **layout)
        result["metrics"] = torch.load(out / "metrics.pt")
        return result

    single = distil(tmp_path / "one")
    ep2 = distil(tmp_path / "ep2", devices=2, strategy_kwargs=dict(expert_model_parallel_size=2))
    torch.testing.assert_close(
        torch.tensor(ep2["metrics"])[:, :2], torch.tensor(single["metrics"])[:, :2], rtol=1e-5, atol=0
    )
    assert_same_training(ep2, single)
