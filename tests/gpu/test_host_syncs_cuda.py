"""No host sync inside a training step on a GPU: the step runs under torch.cuda.set_sync_debug_mode("error"),
which raises at any operation that waits for the device (``.item()``, a blocking copy, ``nonzero``...).

The engine's step alone, and GPTModule's ``training_step`` under a Lightning Trainer (the engine step, Lightning's
optimizer wrapper and the module's logging). The NaN check before the update is the one sync a step keeps by
default (docs/extending.md, "Host syncs"): the strict runs switch it off, and one run checks that it is the only one.
tests/unit/test_step_host_syncs.py counts the same on CPU.
"""

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch

import megatron_lite as ml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_step_host_syncs import _engine  # noqa: E402

NO_CUDA = "needs CUDA: no NVIDIA GPU visible on this machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def _cuda_engine(kind: str, **optimizer):
    with torch.device("cuda"):  # parameters, gradient buffers and optimizer state on the GPU
        return _engine(kind, **optimizer)


def _batches(steps: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [[{"tokens": torch.randint(0, 128, (2, 9), generator=g).cuda()} for _ in range(2)] for _ in range(steps)]


def _strict(run):
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", ["fp32", "zero1"])
def test_an_engine_step_does_not_sync(kind):
    engine = _cuda_engine(kind, check_for_nan_in_grad=False)
    first, *later = _batches(3)
    engine.train_step(first)  # one-time work: the report's names, the optimizer's state
    for microbatches in later:
        step, result = _strict(functools.partial(engine.train_step, microbatches))
    assert torch.isfinite(step.loss) and not result.skipped


@pytest.mark.parametrize("kind", ["fp32", "fp16"])
def test_the_non_finite_check_is_the_only_sync_of_a_default_step(kind):
    engine = _cuda_engine(kind)
    first, *later = _batches(3)
    engine.train_step(first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for microbatches in later:
                engine.train_step(microbatches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == len(later), [(w.filename, w.lineno, str(w.message)) for w in syncs]
    assert all(w.filename.endswith("core/optim/optimizer.py") for w in syncs), [(w.filename, w.lineno) for w in syncs]


class StrictModule(ml.GPTModule):
    """Runs every training step after the first under sync debug mode "error"."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            return super().training_step(batch, batch_idx)
        return _strict(lambda: super(StrictModule, self).training_step(batch, batch_idx))


def test_a_lightning_training_step_does_not_sync(tmp_path):
    import lightning as L

    from megatron_lite.data.mock import MockGPTDataModule

    config = ml.GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16)
    module = StrictModule(config, optimizer=ml.OptimizerConfig(lr=1e-3, check_for_nan_in_grad=False), seed=1)
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=7)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="gpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert trainer.global_step == 4
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
