"""``megatron-lite plot``: a PNG from the CSV and TensorBoard logs of a real run, drawing exactly the
logged values; errors that name the fix (exit 2)."""

import csv
import os
import shutil

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.cli.plot import DPI, FIGURE_INCHES, load_run, main, plot_run
from megatron_lite.data import MockGPTDataModule

SEQ, STEPS = 16, 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A single-process run with validation, logging to CSV and TensorBoard under one directory."""
    root = tmp_path_factory.mktemp("plot_run")
    config = ml.GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=256,
        seq_length=SEQ,
        make_vocab_size_divisible_by=32,
    )
    data = MockGPTDataModule(seq_length=SEQ, micro_batch_size=2, global_batch_size=4, vocab_size=256, seed=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        log_every_n_steps=1,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=[CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")],
        callbacks=[MegatronMetrics(peak_tflops_per_device=1.0, console=False)],
    )
    optimizer = ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=STEPS, min_lr=1e-4)
    trainer.fit(ml.GPTModule(config, optimizer), data)
    return root


def _csv(root) -> dict:
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    return {
        tag: {int(r["step"]): float(r[tag]) for r in rows if r.get(tag)}
        for tag in ("train/loss", "val/loss", "train/lr", "train/tokens_per_sec")
    }


def test_writes_a_png_of_the_logged_values(run_dir, tmp_path, capsys):
    out = tmp_path / "plots" / "run.png"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (FIGURE_INCHES[0] * DPI, FIGURE_INCHES[1] * DPI)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16)) > 10  # drawn, not a blank canvas


def test_the_panels_draw_exactly_the_logged_series(run_dir, tmp_path):
    logged = _csv(run_dir)
    assert sorted(logged["train/loss"]) == list(range(STEPS)) and sorted(logged["val/loss"]) == [2, 5]
    figure = plot_run(load_run(run_dir), tmp_path / "p.png", title="t")
    loss_axes, lr_axes, speed_axes = figure.axes[:3]
    drawn = {line.get_label(): dict(zip(line.get_xdata(), line.get_ydata())) for line in loss_axes.get_lines()}
    assert drawn["train"] == pytest.approx(logged["train/loss"], rel=1e-6)  # TensorBoard keeps float32
    assert drawn["validation"] == pytest.approx(logged["val/loss"], rel=1e-6)
    lr = lr_axes.get_lines()[0]
    assert dict(zip(lr.get_xdata(), lr.get_ydata())) == pytest.approx(logged["train/lr"], rel=1e-6)
    speed = speed_axes.get_lines()[0]
    assert dict(zip(speed.get_xdata(), speed.get_ydata())) == pytest.approx(logged["train/tokens_per_sec"], rel=1e-6)
    assert sorted(logged["train/tokens_per_sec"]) == list(range(1, STEPS))  # the warm-up step has no rate
    assert "TFLOP/s/device" in speed_axes.get_title() and "MFU" in speed_axes.get_title()


def test_csv_alone_and_tensorboard_alone_give_the_same_series(run_dir):
    from_csv = load_run(run_dir / "csv")
    from_tb = load_run(run_dir / "tb")
    assert [p.name for p in from_csv.sources] == ["metrics.csv"]
    assert [p.name for p in from_tb.sources] == ["version_0"]
    for tag in ("train/loss", "val/loss", "train/lr", "train/tokens_per_sec"):
        assert from_tb.series[tag] == pytest.approx(from_csv.series[tag], rel=1e-6), tag


def test_default_output_and_newest_of_several_runs(run_dir, tmp_path, capsys):
    copy = tmp_path / "runs"
    shutil.copytree(run_dir / "csv", copy)
    older = copy / "version_0" / "metrics.csv"
    newer = copy / "version_1" / "metrics.csv"
    newer.parent.mkdir()
    rows = older.read_text().splitlines()
    newer.write_text("\n".join(rows[:3]) + "\n")  # a shorter, newer run
    os.utime(older, (1_000_000_000, 1_000_000_000))
    assert main([str(copy)]) == 0
    out = capsys.readouterr().out
    assert (copy / "metrics.png").is_file()
    assert f"from {newer}" in out and f"not plotted (pass a version directory to plot one): {older}" in out
    assert load_run(copy).series["train/loss"].keys() == {0, 1}


def test_problems_exit_2_with_a_message_that_names_the_fix(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist; pass the directory the run logged into" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no metrics.csv or TensorBoard event files under" in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("step,epoch,other\n0,0,1.5\n")
    assert main([str(tmp_path)]) == 2
    assert "train with GPTModule (loss, lr) and the MegatronMetrics callback" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()
    assert main([]) == 2  # usage error from argparse
    assert main(["--help"]) == 0
