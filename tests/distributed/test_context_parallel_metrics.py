"""MegatronMetrics and the sample counts under context parallelism (CP2 through a real Trainer).

Each CP rank runs s/C tokens of every sample, but the global batch is unchanged: consumed samples, the
sample-based LR schedule, tokens/s (the whole job's) and FLOPs per device (the model's FLOPs over all
devices, CP ranks included) must be those of the global batch, not C times or 1/C of them.
"""

import csv
from contextlib import redirect_stdout
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger
from parity_utils import tiny_config

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.core.estimator.flops import training_flops_per_step
from megatron_lite.data import MockGPTDataModule

GBS, MBS, SEQ, STEPS = 8, 2, 32, 6
PEAK_TFLOPS = 0.05


def _fit(root: Path, devices: int, cp: int) -> dict:
    config = tiny_config(seq_length=SEQ)
    optimizer = ml.OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_samples=2 * GBS, lr_decay_samples=5 * GBS)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(context_parallel_size=cp, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=CSVLogger(root, name="csv"),
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MegatronMetrics(PEAK_TFLOPS, timers_interval=0)],
    )
    data = MockGPTDataModule(
        seq_length=SEQ, micro_batch_size=MBS, global_batch_size=GBS, vocab_size=config.vocab_size, seed=7
    )
    with open(root / "console.txt", "w") as console, redirect_stdout(console):
        trainer.fit(ml.GPTModule(config, optimizer), data)
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    series = {
        tag: {int(r["step"]): float(r[tag]) for r in rows if r.get(tag)}
        for tag in ("train/lr", "train/consumed_samples", "train/tokens_per_sec", "train/tflops_per_device")
    }
    iterations = [
        dict(part.split(": ") for part in line.split(" | ")[1:] if ": " in part)
        for line in (root / "console.txt").read_text().splitlines()
        if line.startswith("iteration")
    ]
    return {"series": series, "iterations": iterations, "config": config}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        name: _fit(tmp_path_factory.mktemp(name), devices, cp)
        for name, devices, cp in (("single", 1, 1), ("cp2", 2, 2))
    }


def test_consumed_samples_and_the_sample_based_lr_count_global_samples(runs):
    cp2, single = runs["cp2"]["series"], runs["single"]["series"]
    assert cp2["train/consumed_samples"] == {step: float((step + 1) * GBS) for step in range(STEPS)}
    assert cp2["train/lr"].keys() == single["train/lr"].keys() and len(cp2["train/lr"]) == STEPS
    for step, lr in single["train/lr"].items():
        assert cp2["train/lr"][step] == pytest.approx(lr, rel=1e-6)


def test_tokens_per_second_and_flops_per_device_are_the_global_batchs(runs):
    run = runs["cp2"]
    tokens, tflops = run["series"]["train/tokens_per_sec"], run["series"]["train/tflops_per_device"]
    assert tokens.keys() == tflops.keys() and len(tokens) == STEPS - 1  # the first step is warm-up
    flops_per_token = training_flops_per_step(run["config"], GBS, SEQ) / (GBS * SEQ)
    for step, rate in tokens.items():
        # FLOPs per device = the global batch's FLOPs over both devices: both figures come from one clock.
        assert tflops[step] * 1e12 * 2 / rate == pytest.approx(flops_per_token, rel=1e-9)
    ms_per_step = [
        float(it["elapsed time per iteration (ms)"])
        for it in run["iterations"]
        if "elapsed time per iteration (ms)" in it
    ]
    logged = [tokens[step] for step in sorted(tokens)]
    assert len(ms_per_step) == len(logged) == STEPS - 1
    for rate, ms in zip(logged, ms_per_step):
        # A step's tokens are the global batch's (GBS x SEQ), not one CP rank's share (ms printed to 0.1).
        assert abs(rate * ms / 1000 - GBS * SEQ) <= rate * 0.05 / 1000 * 1.001
