"""Everything around the training step under pipeline parallelism, through a real Trainer:
validation (forward-only schedule, sanity check), predict, generation and checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from parity_utils import run, tiny_config  # noqa: E402

CONFIG = dict(num_layers=4)
PROMPTS = [[5, 17, 42, 8], [7, 7, 7]]


def _data():
    return MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, vocab_size=1000, seed=7)


class SaveOutputs(L.Callback):
    """Rank 0 saves the predictions and, after fit, a greedy continuation of PROMPTS (run on every rank)."""

    def __init__(self, out: Path):
        self.out = out

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            torch.save(outputs, self.out / "logits.pt")

    def on_train_end(self, trainer, pl_module):
        tokens = pl_module.generate(PROMPTS, max_new_tokens=6).tokens
        if trainer.global_rank == 0:
            torch.save(tokens, self.out / "generated.pt")


def _trainer(devices: int, pp: int, tmp_path: Path, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(pipeline_model_parallel_size=pp, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveOutputs(tmp_path)],
        **kwargs,
    )


@pytest.mark.parametrize("pp, vpp", [(2, 1), (2, 2)])
def test_validation_predict_and_generation_match_one_process(tmp_path, pp, vpp):
    results = {}
    for name, devices in (("single", 1), ("pp", pp)):
        out = tmp_path / name
        out.mkdir()
        strategy = dict(
            pipeline_model_parallel_size=devices,
            virtual_pipeline_model_parallel_size=vpp if devices > 1 else 1,
            start_method="fork",
        )
        fit = L.Trainer(
            strategy=ml.MegatronStrategy(**strategy),
            accelerator="cpu",
            devices=devices,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=3,
            val_check_interval=3,
            limit_val_batches=2,
            num_sanity_val_steps=2,
            callbacks=[SaveOutputs(out)],
        )
        module = ml.GPTModule(tiny_config(**CONFIG), ml.OptimizerConfig(lr=1e-2))
        fit.fit(module, _data())
        predictor = L.Trainer(
            strategy=ml.MegatronStrategy(**strategy),
            accelerator="cpu",
            devices=devices,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[SaveOutputs(out)],
        )
        tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        predictor.predict(
            ml.GPTModule(tiny_config(**CONFIG)),
            torch.utils.data.DataLoader([{"tokens": tokens}], batch_size=None),
            return_predictions=False,
        )
        results[name] = dict(
            val=float(fit.callback_metrics["val/loss"]),
            logits=torch.load(out / "logits.pt"),
            generated=torch.load(out / "generated.pt"),
        )
    single, piped = results["single"], results["pp"]
    assert piped["val"] == pytest.approx(single["val"], rel=1e-5)
    assert piped["logits"].shape == (2, 16, 1000)
    torch.testing.assert_close(piped["logits"], single["logits"], rtol=1e-5, atol=1e-5)
    assert piped["generated"] == single["generated"]
    assert [len(t) for t in piped["generated"]] == [6, 6]


def test_checkpoint_resume_under_pipeline_gives_the_same_next_losses(tmp_path):
    """PP2 x DP... here PP2 (tied embeddings on both end stages): save at step 3, resume, compare steps 4-6."""
    config = tiny_config(**CONFIG, share_embeddings_and_output_weights=True)
    full = run(tmp_path / "full", devices=2, pp=2, steps=6, config=config)
    ckpt_dir = tmp_path / "ckpts"
    run(
        tmp_path / "first",
        devices=2,
        pp=2,
        steps=3,
        config=config,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)],
    )
    saved = ckpt_dir / "epoch=0-step=3.ckpt"
    assert (saved / ".metadata").is_file()
    resumed = run(tmp_path / "resumed", devices=2, pp=2, steps=6, config=config, ckpt_path=str(saved))
    assert resumed["global_step"] == 6
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0)
