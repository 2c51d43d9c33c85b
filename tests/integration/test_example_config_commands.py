"""Every ``megatron-lite ...`` command written in the header comments of ``examples/configs/*.yaml`` runs as
written, from a directory laid out like the repository root (the headers say to run them from there), through
the real CLI in this process. A fit is shortened to 2 steps (4 for the resume recipe) with one validation batch,
its ranks forked, its checkpoints saved at every step. gpt_tiny.yaml's resume recipe (``--ckpt_path last``)
continues the first run at step 2 from the config's own checkpoint directory.

Lightning's warning about manual optimization at ``every_n_train_steps`` saves, wrong for GPTModule, is checked in
this process (a forked rank's warnings are recorded by pytest's capture there, never printed)."""

from __future__ import annotations

import csv
import shlex
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.cli import main
from megatron_lite.data import MockGPTDataModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_headers import CONFIGS, REPO, SHORT_FIT, header_commands  # noqa: E402


def _run(args: list[str]) -> None:
    try:
        main(args)
    except SystemExit as exit_info:  # the tools exit with their code
        assert exit_info.code in (0, None), f"megatron-lite {shlex.join(args)} exited with {exit_info.code}"


def _steps(logs: Path, metric: str) -> list[int]:
    rows = csv.DictReader(open(next(logs.rglob("metrics.csv"))))
    return sorted({int(r["step"]) for r in rows if r.get(metric)})


def test_the_headers_hold_the_commands_they_should() -> None:
    found = {config.name: [args[0] for args in header_commands(config)] for config in CONFIGS}
    assert found == {
        "deepseek_tiny.yaml": ["fit"],
        "dpo.yaml": ["fit"],
        "gpt_pretrain_bin.yaml": ["preprocess", "fit"],
        "gpt_tiny.yaml": ["fit", "fit", "estimate"],
        "grpo.yaml": ["fit"],
        "loggers.yaml": ["fit", "plot"],
        "moe_tiny.yaml": ["fit", "fit", "estimate"],
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_every_command_in_a_config_header_runs(
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    for name in ("examples", "megatron_lite", "tests"):  # the paths the headers and configs name
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["megatron-lite"])  # LightningCLI warns when it also sees pytest's arguments
    monkeypatch.setenv("WANDB_SILENT", "true")
    for number, args in enumerate(header_commands(config)):
        if args[0] == "fit":
            steps = "4" if "--ckpt_path" in args else "2"
            args = [*args, *SHORT_FIT, "--trainer.max_steps", steps]
            if "loggers.yaml" not in " ".join(args):  # that one's loggers are what it shows: keep them
                args += [
                    "--trainer.logger",
                    "lightning.pytorch.loggers.CSVLogger",
                    "--trainer.logger.save_dir",
                    f"csv{number}",
                ]
        _run(args)
    out = capfd.readouterr().out

    if config.stem == "gpt_tiny":
        # the resume recipe continued the first run (steps 0, 1) at step 2, from the config's checkpoint directory
        assert _steps(tmp_path / "csv0", "train/loss") == [0, 1]
        assert _steps(tmp_path / "csv1", "train/loss") == [2, 3]
        assert (tmp_path / "runs/tiny/checkpoints/last.ckpt").is_dir()
        saved = next((tmp_path / "csv0").rglob("config.yaml")).read_text()
        assert "path: shakespeare" in saved and "tensor_model_parallel_size: 2" in saved
        assert "FLOPs per step:" in out  # estimate printed its table
    elif config.stem == "moe_tiny":
        # EP2 trained, reported its router losses and expert loads, resumed from its own checkpoint
        assert _steps(tmp_path / "csv0", "train/load_balancing_loss") == [0, 1]
        assert _steps(tmp_path / "csv0", "train/moe/layer_3/load_cv") == [0, 1]
        assert _steps(tmp_path / "csv1", "train/loss") == [2, 3]
        assert "FLOPs per step:" in out
    elif config.stem == "gpt_pretrain_bin":
        assert (tmp_path / "data/shakespeare_text_document.idx").is_file()
        assert "sequence_parallel: true" in next((tmp_path / "csv1").rglob("config.yaml")).read_text()
        # the model took its vocabulary from the data's tokenizer
        assert "  vocab_size: 50257" in next((tmp_path / "csv1").rglob("hparams.yaml")).read_text()
    elif config.stem == "dpo":
        assert _steps(tmp_path / "csv0", "train/reward_accuracy") == [0, 1]
        assert _steps(tmp_path / "csv0", "val/reward_accuracy")
        assert "precompute_reference_log_probs: true" in next((tmp_path / "csv0").rglob("config.yaml")).read_text()
    elif config.stem == "grpo":
        assert _steps(tmp_path / "csv0", "train/reward_mean") == [0, 1]
        assert _steps(tmp_path / "csv0", "val/pass_at_k")
        saved = next((tmp_path / "csv0").rglob("config.yaml")).read_text()
        assert "class_path: megatron_lite.rl.GRPOModule" in saved
        assert "reward_fn: megatron_lite.rl.rewards.exact_match" in saved
    elif config.stem == "loggers":  # TensorBoard, CSV and offline W&B together, then `megatron-lite plot`
        run = tmp_path / "runs/tiny"
        assert list((run / "tb").rglob("events.out.tfevents*"))
        assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
        assert _steps(run / "csv", "train/tokens_per_sec") == [1]  # Megatron's metrics (step 0 is warm-up)
        assert _steps(run / "csv", "val/perplexity")
        assert (run / "metrics.png").stat().st_size > 10_000


class _ManualStep(L.LightningModule):
    """A manual-optimization module that is not a GPTModule: Lightning's warning is left alone for it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.layer(batch).pow(2).mean())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_warning_is_silenced_for_gpt_module_only(tmp_path: Path) -> None:
    """ModelCheckpoint(every_n_train_steps=...) warns at every save of a manual-optimization module that the
    checkpoint holds the weights after the optimizer step: GPTModule steps inside training_step, so that is what
    it should hold, and the warning is silenced for it; another manual-optimization module still gets it."""

    def fit(module, data, name):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=1)],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        return [str(w.message) for w in caught if "no pre-optimization state was saved" in str(w.message)]

    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    assert len(fit(_ManualStep(), loader, "plain")) == 2  # one per save: the warning this test looks for
    gpt = ml.GPTModule(ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8))
    assert (
        fit(gpt, MockGPTDataModule(seq_length=8, micro_batch_size=2, global_batch_size=2, vocab_size=64), "gpt") == []
    )
