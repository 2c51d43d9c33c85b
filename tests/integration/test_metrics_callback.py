"""MegatronMetrics in a real Trainer: DP2 with TensorBoard, CSV and offline W&B loggers at once.

Proves: every metric lands at the optimizer steps Lightning logs ``train/loss`` at (every
``log_every_n_steps``, no duplicates, the same step in CSV and TensorBoard); consumed samples,
tokens/s, TFLOP/s per device and MFU agree with the data geometry, the FLOPs estimate and an
independent clock on rank 0; val/perplexity is exp(val/loss); the console line carries the module's
values; the CPU peak is measured once and cached; Lightning's bar advances once per optimizer step.
"""

import csv
import json
import math
import resource
import struct
import time
from contextlib import redirect_stdout
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.callbacks.peak_flops import known_gpu_peak_tflops, precision_dtype
from megatron_lite.core.estimator.flops import training_flops_per_step
from megatron_lite.data import MockGPTDataModule

GBS, SEQ, STEPS, EVERY, WORLD = 8, 16, 6, 2, 2
PEAK_TFLOPS = 0.05
TRAIN_TAGS = [
    "train/consumed_samples",
    "train/tokens_per_sec",
    "train/tflops_per_device",
    "train/mfu",
    "train/mem_peak_gib",
    "timers/forward-backward",
    "timers/optimizer",
]
LOGGED_TRAIN_STEPS = [1, 3, 5]  # Lightning's step of optimizer steps 2, 4, 6 (0-based: steps taken before)
VAL_STEPS = [2, 5]  # validation after optimizer steps 3 and 6


def tiny_config() -> ml.GPTConfig:
    return ml.GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=256,
        seq_length=SEQ,
        make_vocab_size_divisible_by=32,
    )


def tiny_data() -> MockGPTDataModule:
    return MockGPTDataModule(seq_length=SEQ, micro_batch_size=2, global_batch_size=GBS, vocab_size=256, seed=7)


def optimizer() -> ml.OptimizerConfig:
    return ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=1, lr_decay_iters=10, min_lr=1e-4)


# Real time added to every step and validation batch so that what the metrics must measure dwarfs a
# scheduler hiccup between this clock's reading and MegatronMetrics' (the box is shared and loaded).
STEP_SLEEP = 0.1


class RankZeroClock(L.Callback):
    """Rank 0's own clock at each optimizer step's end and around validation (runs before MegatronMetrics)."""

    def __init__(self, out: Path):
        self.out = out
        self.step_ends: list = []
        self.validations: list = []
        self._validation_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(STEP_SLEEP)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        time.sleep(STEP_SLEEP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_ends.append((trainer.global_step, time.perf_counter()))

    def on_validation_start(self, trainer, pl_module):
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations.append((self._validation_start, time.perf_counter()))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
            self.out.write_text(
                json.dumps({"step_ends": self.step_ends, "validations": self.validations, "peak_rss_gib": peak_rss_gib})
            )


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """One DP2 run logging to TensorBoard, CSV and W&B (offline), console captured to a file."""
    root = tmp_path_factory.mktemp("metrics")
    with pytest.MonkeyPatch.context() as env:
        for key, value in dict(
            WANDB_MODE="offline",
            WANDB_SILENT="true",
            WANDB_CONSOLE="off",
            WANDB_DISABLE_GIT="true",
            WANDB_DISABLE_CODE="true",
            WANDB_CONFIG_DIR=str(root / "wandb-config"),
            WANDB_CACHE_DIR=str(root / "wandb-cache"),
            WANDB_DATA_DIR=str(root / "wandb-data"),
        ).items():
            env.setenv(key, value)
        loggers = [
            TensorBoardLogger(root, name="tb"),
            CSVLogger(root, name="csv"),
            WandbLogger(offline=True, save_dir=str(root), project="megatron-lite-test"),
        ]
        trainer = L.Trainer(
            strategy="megatron_fork",
            accelerator="cpu",
            devices=WORLD,
            max_steps=STEPS,
            log_every_n_steps=EVERY,
            logger=loggers,
            val_check_interval=3,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            callbacks=[RankZeroClock(root / "clock.json"), MegatronMetrics(PEAK_TFLOPS, timers_interval=2 * EVERY)],
        )
        with open(root / "console.txt", "w") as console, redirect_stdout(console):
            trainer.fit(ml.GPTModule(tiny_config(), optimizer()), tiny_data())
    csv_rows = list(csv.DictReader(open(next((root / "csv").rglob("metrics.csv")))))
    return {
        "root": root,
        "csv": csv_rows,
        "clock": json.loads((root / "clock.json").read_text()),
        "console": (root / "console.txt").read_text(),
    }


def _csv_series(rows, tag) -> dict:
    return {int(r["step"]): float(r[tag]) for r in rows if r.get(tag)}


def test_csv_has_every_metric_once_at_the_optimizer_steps(dp2_run):
    rows = dp2_run["csv"]
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert train_steps == LOGGED_TRAIN_STEPS
    for tag in TRAIN_TAGS:
        assert [int(r["step"]) for r in rows if r.get(tag)] == LOGGED_TRAIN_STEPS, tag
    assert [int(r["step"]) for r in rows if r.get("val/perplexity")] == VAL_STEPS
    assert not any(r.get("timers/batch-generator") for r in rows)  # level 2, above the default level 1


def test_consumed_samples_are_the_samples_of_the_steps_taken(dp2_run):
    consumed = _csv_series(dp2_run["csv"], "train/consumed_samples")
    assert consumed == {step: (step + 1) * GBS for step in LOGGED_TRAIN_STEPS}


def test_throughput_matches_an_independent_clock_and_the_flops_estimate(dp2_run):
    """tokens/s = tokens of the steps since the last log / their wall time (the first step and the
    validation excluded), measured by another callback on rank 0. Compared as seconds: each interval
    holds >= 0.1 s of sleep per step, the warm-up step or a validation would add >= 0.1 s, and 10 ms
    covers the two callbacks reading the clock at slightly different moments."""
    ends = dict(dp2_run["clock"]["step_ends"])
    validations = dp2_run["clock"]["validations"]
    tokens_per_sec = _csv_series(dp2_run["csv"], "train/tokens_per_sec")
    tflops = _csv_series(dp2_run["csv"], "train/tflops_per_device")
    mfu = _csv_series(dp2_run["csv"], "train/mfu")
    flops_per_step = training_flops_per_step(tiny_config(), GBS, SEQ)
    previous = 1  # the warm-up step is not timed
    for logged_step in LOGGED_TRAIN_STEPS:
        step = logged_step + 1
        start, end = ends[previous], ends[step]
        paused = sum(b - a for a, b in validations if start < a < end)
        measured = (step - previous) * GBS * SEQ / tokens_per_sec[logged_step]
        assert measured == pytest.approx(end - start - paused, abs=0.01)
        seconds_per_step = GBS * SEQ / tokens_per_sec[logged_step]
        assert tflops[logged_step] == pytest.approx(flops_per_step / seconds_per_step / WORLD / 1e12, rel=1e-9)
        assert mfu[logged_step] == pytest.approx(tflops[logged_step] / PEAK_TFLOPS, rel=1e-12)
        previous = step
    assert validations and any(ends[2] < a < ends[4] for a, _ in validations)  # the pause was exercised


def test_memory_is_the_peak_rss_of_rank_zero(dp2_run):
    memory = _csv_series(dp2_run["csv"], "train/mem_peak_gib")
    values = [memory[s] for s in LOGGED_TRAIN_STEPS]
    assert 0 < values[0] and values == sorted(values)  # a peak never decreases
    # Rank 0's peak at its last log is nearly its peak at the end (the same steps ran since).
    assert 0.8 * dp2_run["clock"]["peak_rss_gib"] <= values[-1] <= dp2_run["clock"]["peak_rss_gib"]


def test_perplexity_is_exp_of_the_validation_loss(dp2_run):
    loss = _csv_series(dp2_run["csv"], "val/loss")
    perplexity = _csv_series(dp2_run["csv"], "val/perplexity")
    assert perplexity.keys() == loss.keys()
    for step, value in perplexity.items():
        assert value == pytest.approx(math.exp(loss[step]), rel=1e-9)


def test_tensorboard_has_the_same_values_at_the_same_steps(dp2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(next((dp2_run["root"] / "tb").glob("version_*"))), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    expected = {tag: LOGGED_TRAIN_STEPS for tag in TRAIN_TAGS + ["train/loss", "train/lr"]}
    expected.update({"val/loss": VAL_STEPS, "val/perplexity": VAL_STEPS})
    assert set(expected) <= tags
    for tag, steps in expected.items():
        events = accumulator.Scalars(tag)
        assert [e.step for e in events] == steps, tag
        from_csv = _csv_series(dp2_run["csv"], tag)
        for e in events:
            assert e.value == pytest.approx(from_csv[e.step], rel=1e-6), tag  # TensorBoard stores float32


def test_console_prints_megatrons_iteration_line(dp2_run):
    lines = [line for line in dp2_run["console"].splitlines() if line.startswith("iteration")]
    assert len(lines) == len(LOGGED_TRAIN_STEPS)
    rows = dp2_run["csv"]
    loss = _csv_series(rows, "train/loss")
    lr = _csv_series(rows, "train/lr")
    tokens_per_sec = _csv_series(rows, "train/tokens_per_sec")
    for line, logged_step in zip(lines, LOGGED_TRAIN_STEPS):
        fields = dict(part.strip().split(": ", 1) for part in line.rstrip(" |").split(" | ")[1:])
        assert line.split(" | ")[0].split() == ["iteration", f"{logged_step + 1}/", f"{STEPS}"]
        assert int(fields["consumed samples"]) == (logged_step + 1) * GBS
        assert fields["elapsed time per iteration (ms)"] == f"{1000 * GBS * SEQ / tokens_per_sec[logged_step]:.1f}"
        assert fields["loss"] == f"{loss[logged_step]:.6E}"
        assert fields["learning rate"] == f"{lr[logged_step]:.6E}"
        assert int(fields["global batch size"]) == GBS
        assert {"throughput per device (TFLOP/s/device)", "grad norm"} <= fields.keys()
    # The timer block every timers_interval=4 steps only: after iteration 4, with each timer's per-step
    # times over steps 1-4, so its max across ranks is at most the mean of the two logged interval maxima.
    console = dp2_run["console"].splitlines()
    headers = [i for i, line in enumerate(console) if line == "(min, max) time across ranks (ms):"]
    assert len(headers) == 1 and console[headers[0] - 1].split()[:2] == ["iteration", f"{2 * EVERY}/"]
    block = {line.split()[0]: line for line in console[headers[0] + 1 :] if line.startswith("    ")}
    low, high = map(float, block["forward-backward"].split(": (")[1].rstrip(")").split(", "))
    logged = _csv_series(rows, "timers/forward-backward")
    assert 0 < low <= high <= (logged[LOGGED_TRAIN_STEPS[0]] + logged[LOGGED_TRAIN_STEPS[1]]) / 2 + 0.005


def test_wandb_offline_run_is_written_without_network(dp2_run):
    runs = list((dp2_run["root"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert len(list(runs[0].glob("run-*.wandb"))) == 1
    assert (runs[0] / "files").is_dir() and (runs[0] / "logs" / "debug-internal.log").is_file()


def _wandb_history(path: Path) -> list:
    """History rows of a ``.wandb`` file (W&B's LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    block, pos, records, pending = 32768, 7, [], b""  # 7: the ":W&B" file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # block trailer
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_history_has_the_metrics_at_the_optimizer_steps(dp2_run):
    run_file = next((dp2_run["root"] / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = _wandb_history(run_file)
    train = [r for r in rows if "train/loss" in r]
    assert [r["trainer/global_step"] for r in train] == LOGGED_TRAIN_STEPS
    tokens_per_sec = _csv_series(dp2_run["csv"], "train/tokens_per_sec")
    assert all(r["train/tokens_per_sec"] == tokens_per_sec[r["trainer/global_step"]] for r in train)


def test_cpu_peak_is_measured_once_and_cached_and_the_bar_counts_optimizer_steps(tmp_path):
    """Single process: MFU divides by a matmul peak measured on the first fit and reused by the next."""
    callback = MegatronMetrics()
    ratios = []
    for run in range(2):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=3,
            log_every_n_steps=1,
            limit_val_batches=0,
            logger=CSVLogger(tmp_path, name=f"run{run}"),
            # Lightning's default bar is Rich's whenever rich is installed (transformers pulls
            # it in): name the bar whose tick count is checked
            callbacks=[callback, TQDMProgressBar()],
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(ml.GPTModule(tiny_config(), optimizer()), tiny_data())
        assert trainer.progress_bar_callback.train_progress_bar.n == 3  # one tick per optimizer step
        rows = list(csv.DictReader(open(next((tmp_path / f"run{run}").rglob("metrics.csv")))))
        ratios += [float(r["train/tflops_per_device"]) / float(r["train/mfu"]) for r in rows if r.get("train/mfu")]
    assert list(callback._measured_peaks) == [("cpu", torch.float32, torch.get_num_threads())]
    peak = callback._measured_peaks[("cpu", torch.float32, torch.get_num_threads())]
    assert len(ratios) == 4  # steps 2 and 3 of each run (step 1 is warm-up)
    assert ratios == pytest.approx([peak] * 4, rel=1e-12)
    assert 1e-4 < peak < 100  # TFLOP/s: 0.1 GFLOP/s .. 100 TFLOP/s on any CPU


def test_gpu_peaks_by_name_and_precision():
    assert precision_dtype("bf16-mixed") == torch.bfloat16 and precision_dtype("16-mixed") == torch.float16
    assert precision_dtype("32-true") == torch.float32 and precision_dtype("transformer-engine") == torch.float32
    assert known_gpu_peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert known_gpu_peak_tflops("NVIDIA A100 80GB PCIe", torch.float16) == 312.0
    assert known_gpu_peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert known_gpu_peak_tflops("NVIDIA H100 PCIe", torch.bfloat16) == 756.5
    assert known_gpu_peak_tflops("NVIDIA H200", torch.bfloat16) == 989.4
    assert known_gpu_peak_tflops("NVIDIA H200", torch.float32) == 66.9
    assert known_gpu_peak_tflops("NVIDIA H200", torch.float32, tf32=True) == 494.7
    assert known_gpu_peak_tflops("NVIDIA A100-SXM4-40GB", torch.float32) == 19.5
    assert known_gpu_peak_tflops("NVIDIA GeForce RTX 3090", torch.bfloat16) is None
    assert known_gpu_peak_tflops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="peak_tflops_per_device must be a positive number"):
        MegatronMetrics(peak_tflops_per_device=0)
    with pytest.raises(ValueError, match="log_level must be an integer in 0..2"):
        MegatronMetrics(timing_log_level=5)


@pytest.mark.parametrize("log_metrics", [True, False], ids=["default_on", "removed"])
def test_the_strategy_adds_the_metrics_callback_by_default(tmp_path, log_metrics):
    logger = CSVLogger(tmp_path, name="csv")
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=log_metrics),
        devices=1,
        accelerator="cpu",
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(ml.GPTModule(tiny_config(), optimizer()), tiny_data())
    columns = set(next(csv.DictReader(open(next(tmp_path.rglob("metrics.csv"))))))
    assert "train/loss" in columns
    assert ("train/tokens_per_sec" in columns) == log_metrics
    assert ("train/consumed_samples" in columns) == log_metrics
    # the optimizer's phases, timed with Megatron's names through the callback's timers
    assert ({"timers/all-grads-sync", "timers/optimizer-clip-main-grad"} <= columns) == log_metrics


def test_energy_is_absent_on_cpu_with_the_reason(dp2_run):
    from megatron_lite.callbacks.energy import EnergyMeter

    meter = EnergyMeter(torch.device("cpu"))
    assert not meter.available and "needs an NVIDIA GPU" in meter.reason
    assert meter.joules_since_last() is None
    assert all("train/energy_per_step_j" not in row for row in dp2_run["csv"])


def test_validation_loss_is_the_mean_over_every_loss_token_and_perplexity_its_exp(tmp_path):
    """Two validation batches with very different numbers of loss tokens: the epoch's val/loss is the
    token-weighted mean (torchmetrics MeanMetric), not the mean of the two batch means."""
    from torch.utils.data import DataLoader

    config = tiny_config()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 4, config.seq_length + 1), generator=gen)
    masks = torch.zeros(2, 4, config.seq_length)
    masks[0, :, :] = 1  # every token counts
    masks[1, 0, :2] = 1  # two tokens count
    batches = [{"tokens": tokens[i], "loss_mask": masks[i]} for i in range(2)]

    class Data(L.LightningDataModule):
        micro_batch_size, global_batch_size, seq_length = 4, 4, config.seq_length

        def val_dataloader(self):
            return DataLoader(batches, batch_size=None)

    module = ml.GPTModule(config, optimizer(), seed=3)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        devices=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(module, Data())
    reference = ml.GPTModel(config, seed=3).eval()
    with torch.no_grad():
        per_token = [reference(b["tokens"][:, :-1], b["tokens"][:, 1:]) * b["loss_mask"] for b in batches]
    expected = sum(t.sum() for t in per_token) / masks.sum()
    assert metrics["val/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["val/perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-5)
