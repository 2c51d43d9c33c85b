#!/usr/bin/env python
"""Throughput and MFU: megatron-lite against a plain PyTorch loop and Lightning's own strategies.

One benchmark model (``GPTConfig``: 4 layers, hidden 256, 8 heads, vocabulary 4096, sequence 256; global
batch 8, one microbatch per data-parallel rank), trained for ``--steps`` steps by each runner in turn,
all in one run. For each runner: median step time, ``tokens/s = global_batch * seq_length / step``,
model TFLOP/s per device (``training_flops_per_step / step / world_size``) and MFU against one CPU peak
(``measure_matmul_tflops(cpu, fp32)`` at one thread, measured once, the same for every row).

Runners (every process uses one torch thread, CPU and gloo):

1. *plain*: ``GPTModel`` + ``build_optimizer`` (AdamW) + ``clip_grad_norm_`` in a hand-written loop, 1 process
   (``overhead.PlainLoop``) -- the baseline of the 1-process rows.
2. *megatron*: ``GPTModule`` + ``MegatronStrategy(log_metrics=False)``, 1 process, in this process.
3. *megatron_dp2*: the same, ``devices=2`` (DP2), ranks forked.
4. *lightning_ddp*: Lightning's ``DDPStrategy(start_method="fork")``, ``devices=2``, with a minimal
   automatic-optimization LightningModule around the same ``GPTModel``, the same AdamW and clipping
   (``Trainer(gradient_clip_val=...)``), on the same ``MockGPTDataModule`` (its sampler reads the
   strategy's ``distributed_sampler_kwargs``: 4 samples per rank).
5. *megatron_tp2*: ``MegatronStrategy(tensor_model_parallel_size=2)``, ``devices=2``, ranks forked.
6. *lightning_model_parallel_tp2*: Lightning's ``ModelParallelStrategy(data_parallel_size=1,
   tensor_parallel_size=2)`` on CPU/gloo. torch's ``parallelize_module`` cannot shard our model
   (``ColwiseParallel``/``RowwiseParallel`` raise "currently only support nn.Linear and nn.Embedding",
   and ``GPTModel``'s TP layers are ``ColumnParallelLinear``/``RowParallelLinear``/``VocabParallelEmbedding``),
   and a plain-torch look-alike would not be the same model. So the minimal module builds the same
   ``GPTModel`` with its own TP layers over a ``ParallelLayout`` of the strategy's process group in
   ``configure_model`` (the hook the strategy asks users to parallelize in), and clips the global norm
   across TP shards with the core's ``clip_grad_norm``. The strategy has no fork launcher: it re-runs this
   script for rank 1, so its rank 0 runs in a fresh ``python throughput.py`` too (forking ranks from a process
   that held a 2-rank group crashed them). If it cannot run, the row says why, without numbers.

Ratios are of tokens/s (above 1: faster): every 1-process row against the plain loop, DP2 against
``ddp``, TP2 against ``ModelParallelStrategy``, DP2 and TP2 against 1-process MegatronStrategy. Also
shown: rank 0's median process CPU time per step, steadier than wall time when other jobs share the
machine. All runners start from the same weights (seeded) on the same data with a constant learning
rate, so they train identically up to fp32 rounding: the largest loss difference against the plain loop
is printed as a check that they ran the same model on the same data (it is blind to the clipping norm:
Adam barely notices a gradient scale), and so are the samples each rank got per step.

Last, a short 1-process run with MegatronStrategy's default ``MegatronMetrics`` callback and a
``CSVLogger`` (to a temporary folder): its logged ``train/tokens_per_sec`` and ``train/mfu`` are shown
beside this script's own measurement of the same run (MegatronMetrics times batch end to batch end;
the comparable number here is the loop interval, start to start).

Timing as in ``overhead.py``: the step window runs from ``on_train_batch_start`` to
``on_train_batch_end`` (a Callback), the first ``--warmup`` steps are dropped. Never asserted on.

Run from the repository root: ``python benchmarks/throughput.py [--steps 12 --warmup 3 --repeats 1 --out ...]``
(``--repeats 2`` runs every runner twice, in ABBA order).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; see overhead.py

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for path in (REPO_ROOT, BENCH_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import lightning as L  # noqa: E402
import overhead  # noqa: E402  (benchmarks/overhead.py: PlainLoop, StepTimer, _restore_environ, _summary)
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks.peak_flops import measure_matmul_tflops  # noqa: E402
from megatron_lite.core.estimator.flops import training_flops_per_step  # noqa: E402
from megatron_lite.core.optim import build_optimizer  # noqa: E402
from megatron_lite.core.optim.clip_grads import clip_grad_norm  # noqa: E402
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "throughput.json"
# The ModelParallelStrategy run happens in a fresh `python throughput.py` (rank 0), whose launcher re-runs
# that script for rank 1: this variable makes both run only that runner, and RESULT_ENV names the file
# rank 0 writes. Not in this process: forking ranks after it held a 2-rank process group crashed them.
CHILD_RUNNER_ENV = "ML_THROUGHPUT_CHILD_RUNNER"
RESULT_ENV = "ML_THROUGHPUT_RESULT_FILE"
MODEL_PARALLEL = "lightning_model_parallel_tp2"
MODEL_PARALLEL_NOTE = (
    "ModelParallelStrategy runs on CPU/gloo (lightning 2.6.6, torch 2.13), but torch's parallelize_module cannot "
    "shard GPTModel: ColwiseParallel/RowwiseParallel 'currently only support nn.Linear and nn.Embedding' and its TP "
    "layers are ColumnParallelLinear/RowParallelLinear/VocabParallelEmbedding. The row runs the same GPTModel with "
    "its own TP layers, built in configure_model over a ParallelLayout of the strategy's process group, under "
    "Lightning's automatic optimization, with the global norm clipped across TP shards by the core's clip_grad_norm."
)
# How long rank 0 waits for the re-run rank 1 in a collective before the row is recorded as failed.
MODEL_PARALLEL_TIMEOUT = timedelta(minutes=3)


class LightningGPT(L.LightningModule):
    """What a Lightning user would write around ``GPTModel``: automatic optimization, the model's
    per-token losses averaged, ``build_optimizer``'s AdamW. With ``tensor_parallel > 1`` the model is
    built in ``configure_model`` over a ``ParallelLayout`` of the strategy's process group."""

    def __init__(self, config: ml.GPTConfig, opt_cfg: ml.OptimizerConfig, tensor_parallel: int = 1):
        super().__init__()
        self.config, self.opt_cfg, self.tensor_parallel = config, opt_cfg, tensor_parallel
        self.layout: Optional[ParallelLayout] = None
        # replicated (ddp): built here, before the ranks fork; TP: built per rank in configure_model
        self.model = ml.GPTModel(config, seed=overhead.MODEL_SEED) if tensor_parallel == 1 else None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=self.tensor_parallel))
        self.model = ml.GPTModel(self.config, self.layout, seed=overhead.MODEL_SEED)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        tokens = batch["tokens"]
        return self.model(tokens[:, :-1], tokens[:, 1:]).mean()

    def configure_optimizers(self):
        return build_optimizer(self.model, self.opt_cfg)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.layout is None:  # replicated model (ddp): Lightning's clip_grad_norm_ sees whole gradients
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # TP shards: the norm must sum squares over both shards (clip_grad_norm_ would see half a model)
        clip_grad_norm(self.model.parameters(), self.opt_cfg.clip_grad, self.layout)


class ThroughputTimer(overhead.StepTimer):
    """``overhead.StepTimer`` that also records rank 0's samples per step (the geometry check); with
    ``reduce_loss`` it records the mean loss over ranks (ddp's loss is this rank's half of the batch),
    after the step's clock has stopped."""

    def __init__(self, out_file: Path, reduce_loss: bool = False):
        super().__init__(out_file)
        self.reduce_loss = reduce_loss
        self.samples_per_rank: Optional[int] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.samples_per_rank = int(batch["tokens"].shape[0])
        if self.reduce_loss:
            loss = outputs["loss"].detach().clone()
            self.losses[-1] = float(trainer.strategy.reduce(loss, reduce_op="mean"))

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        if trainer.global_rank == 0:
            result = json.loads(self.out_file.read_text())
            self.out_file.write_text(json.dumps({**result, "samples_per_rank": self.samples_per_rank}))


# --- runners -------------------------------------------------------------------------------------
def run_trainer(
    args,
    module: L.LightningModule,
    strategy,
    *,
    devices: int,
    dp: int,
    reduce_loss: bool = False,
    steps: Optional[int] = None,
    trainer_kwargs: Optional[dict] = None,
) -> dict:
    """One ``Trainer.fit`` on ``MockGPTDataModule`` (one microbatch per DP rank); rank 0's measurements."""
    torch.set_num_threads(overhead.THREADS)
    with tempfile.TemporaryDirectory(prefix="ml_throughput_") as tmp, overhead._restore_environ():
        out_file = Path(tmp) / "rank0.json"
        data = MockGPTDataModule(
            seq_length=args.seq_length,
            micro_batch_size=args.global_batch_size // dp,
            global_batch_size=args.global_batch_size,
            vocab_size=args.vocab_size,
            seed=overhead.DATA_SEED,
        )
        kwargs = dict(logger=False, callbacks=[])
        kwargs.update(trainer_kwargs or {})
        kwargs["callbacks"] = [ThroughputTimer(out_file, reduce_loss), *kwargs["callbacks"]]
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_steps=steps or args.steps,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            **kwargs,
        )
        try:
            trainer.fit(module, data)
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # in-process rank 0: leave nothing for the next run
        for proc in getattr(trainer.strategy.launcher, "procs", []):  # re-run ranks: let them exit first
            if isinstance(proc, subprocess.Popen):  # (forked ranks have been joined by their launcher)
                proc.wait(timeout=120)
        if trainer.global_rank != 0:
            return {}
        return json.loads(out_file.read_text())


def megatron_strategy(tp: int = 1, start_method: str = "fork", log_metrics: bool = False):
    """MegatronStrategy; timed runs leave MegatronMetrics out (its console lines would land in the timing)."""
    return ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method=start_method, log_metrics=log_metrics)


def model_parallel_rank(args, config, opt_cfg) -> dict:
    """Lightning's ModelParallelStrategy, TP2, with our TP layers (see the module docstring); runs in the
    processes :func:`run_model_parallel` starts."""
    overhead._seed()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, timeout=MODEL_PARALLEL_TIMEOUT)
    return run_trainer(args, LightningGPT(config, opt_cfg, tensor_parallel=2), strategy, devices=2, dp=1)


def run_model_parallel(argv: list[str]) -> dict:
    """Rank 0 of the ModelParallelStrategy run in a fresh interpreter (which re-runs itself for rank 1)."""
    with tempfile.TemporaryDirectory(prefix="ml_throughput_mp_") as tmp:
        out_file = Path(tmp) / "rank0.json"
        env = {**os.environ, CHILD_RUNNER_ENV: MODEL_PARALLEL, RESULT_ENV: str(out_file)}
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            env=env,
            timeout=2 * MODEL_PARALLEL_TIMEOUT.total_seconds(),
        )
        if proc.returncode != 0 or not out_file.exists():
            raise RuntimeError(f"the ModelParallelStrategy ranks exited with code {proc.returncode} (output above)")
        return json.loads(out_file.read_text())


def run_metrics_callback(args, config, opt_cfg) -> dict:
    """1 process, MegatronStrategy's default MegatronMetrics, CSVLogger: logged throughput and MFU."""
    overhead._seed()
    with tempfile.TemporaryDirectory(prefix="ml_throughput_csv_") as tmp:
        logger = CSVLogger(tmp, name="metrics")
        run = run_trainer(
            args,
            ml.GPTModule(config, optimizer=opt_cfg, seed=overhead.MODEL_SEED),
            megatron_strategy(start_method="popen", log_metrics=True),
            devices=1,
            dp=1,
            steps=args.metrics_steps,
            trainer_kwargs=dict(logger=logger, log_every_n_steps=1),
        )
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    logged = {
        key: [float(r[key]) for r in rows if r.get(key)]
        for key in ("train/tokens_per_sec", "train/tflops_per_device", "train/mfu")
    }
    return {"run": run, "logged": logged}


def metrics_callback_check(args, config, opt_cfg, peak: float) -> dict:
    """The MegatronMetrics run: medians of what it logged beside this script's measurement of the same run."""
    metrics = run_metrics_callback(args, config, opt_cfg)
    own = summarize([metrics["run"]], args, config, 1, 1, peak)
    skip = max(args.warmup - 1, 0)  # MegatronMetrics' first logged interval already ends at step 2
    logged = {k: float(np.median(v[skip:])) if v[skip:] else None for k, v in metrics["logged"].items()}
    # MegatronMetrics times batch end to batch end: the comparable number here is the loop interval
    interval_tflops = own["tflops_per_device"] * own["median_ms"] / own["interval_median_ms"]
    return {
        "steps": args.metrics_steps,
        "logged": metrics["logged"],
        "logged_median_after_warmup": logged,
        "own_interval_tokens_per_s": own["tokens_per_s"] * own["median_ms"] / own["interval_median_ms"],
        "own_interval_tflops_per_device": interval_tflops,
        "own_interval_mfu": interval_tflops / peak,
        "own_step_window_tokens_per_s": own["tokens_per_s"],
        "callback_peak_tflops": (
            logged["train/tflops_per_device"] / logged["train/mfu"] if logged["train/mfu"] else None
        ),
        "run": own,
    }


def print_callback_check(c: dict) -> None:
    lm = c["logged_median_after_warmup"]
    mfu = lm["train/mfu"]
    print(
        f"MegatronMetrics + CSVLogger ({c['steps']} steps, 1 process, medians after warm-up): logged "
        f"train/tokens_per_sec {_fmt(lm['train/tokens_per_sec'], ',.0f')}, train/tflops_per_device "
        f"{_fmt(lm['train/tflops_per_device'], '.4f')}, train/mfu {_fmt(mfu and mfu * 100, '.1f')}% (against its own "
        f"peak probe, {_fmt(c['callback_peak_tflops'], '.4f')} TFLOP/s)\n  this script on the same run, loop "
        f"interval (what MegatronMetrics times): {c['own_interval_tokens_per_s']:,.0f} tokens/s, "
        f"{c['own_interval_tflops_per_device']:.4f} TFLOP/s, MFU {c['own_interval_mfu'] * 100:.1f}%; step window: "
        f"{c['own_step_window_tokens_per_s']:,.0f} tokens/s"
    )


def runners(args, argv: list[str], config, opt_cfg) -> dict[str, tuple[str, int, Callable[[], dict]]]:
    """name -> (description, world size, run)."""
    plain_args = argparse.Namespace(
        micro_batch_size=args.global_batch_size,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        steps=args.steps,
    )

    def gpt_module():
        overhead._seed()
        return ml.GPTModule(config, optimizer=opt_cfg, seed=overhead.MODEL_SEED)

    def lightning_gpt():
        overhead._seed()
        return LightningGPT(config, opt_cfg)

    return {
        "plain": ("plain PyTorch loop", 1, lambda: overhead.run_plain(config, opt_cfg, plain_args)),
        "megatron": (
            "GPTModule + MegatronStrategy",
            1,
            lambda: run_trainer(args, gpt_module(), megatron_strategy(start_method="popen"), devices=1, dp=1),
        ),
        "megatron_dp2": (
            "GPTModule + MegatronStrategy DP2",
            2,
            lambda: run_trainer(args, gpt_module(), megatron_strategy(), devices=2, dp=2),
        ),
        "lightning_ddp": (
            "Lightning ddp (fork) DP2",
            2,
            lambda: run_trainer(
                args,
                lightning_gpt(),
                DDPStrategy(start_method="fork"),
                devices=2,
                dp=2,
                reduce_loss=True,
                trainer_kwargs=dict(gradient_clip_val=opt_cfg.clip_grad),
            ),
        ),
        "megatron_tp2": (
            "GPTModule + MegatronStrategy TP2",
            2,
            lambda: run_trainer(args, gpt_module(), megatron_strategy(tp=2), devices=2, dp=1),
        ),
        MODEL_PARALLEL: ("Lightning ModelParallelStrategy TP2", 2, lambda: run_model_parallel(argv)),
    }


# --- report --------------------------------------------------------------------------------------
def summarize(reps: list[dict], args, config, world_size: int, tp: int, peak_tflops: float) -> dict:
    """``overhead._summary`` (median over the steps after warm-up of every repetition) plus FLOPs and MFU."""
    tokens_per_step = args.global_batch_size * args.seq_length
    s = overhead._summary(reps, args.warmup, tokens_per_step)
    s["samples_per_rank"] = reps[0].get("samples_per_rank", args.global_batch_size)  # the plain loop: 1 process
    flops = training_flops_per_step(config, args.global_batch_size, args.seq_length, tensor_model_parallel_size=tp)
    s["tflops_per_device"] = flops / (s["median_ms"] / 1e3) / world_size / 1e12
    s["mfu"] = s["tflops_per_device"] / peak_tflops
    s["flops_per_step"] = flops
    return s


def ratio_rows(runs: dict, key: str = "tokens_per_s") -> dict:
    """Ratios row / baseline of ``key`` (tokens/s: above 1, the row is faster; ``cpu_median_ms``: above 1,
    rank 0 of the row works more per step); None where a side is missing."""

    def ratio(a: str, b: str) -> Optional[float]:
        if key not in runs.get(a, {}) or key not in runs.get(b, {}):
            return None
        return runs[a][key] / runs[b][key]

    return {
        "megatron_vs_plain": ratio("megatron", "plain"),
        "megatron_dp2_vs_lightning_ddp": ratio("megatron_dp2", "lightning_ddp"),
        "megatron_tp2_vs_lightning_model_parallel": ratio("megatron_tp2", MODEL_PARALLEL),
        "megatron_dp2_vs_megatron": ratio("megatron_dp2", "megatron"),
        "megatron_tp2_vs_megatron": ratio("megatron_tp2", "megatron"),
        "lightning_ddp_vs_plain_1proc": ratio("lightning_ddp", "plain"),
        "lightning_model_parallel_vs_plain_1proc": ratio(MODEL_PARALLEL, "plain"),
    }


def _fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_report(runs: dict, ratios: dict, descriptions: dict) -> None:
    vs = {
        "plain": ("1.000 (base)", "", ""),
        "megatron": (_fmt(ratios["megatron_vs_plain"]), "", "1.000 (base)"),
        "megatron_dp2": ("", _fmt(ratios["megatron_dp2_vs_lightning_ddp"]), _fmt(ratios["megatron_dp2_vs_megatron"])),
        "lightning_ddp": ("", "1.000 (base)", ""),
        "megatron_tp2": (
            "",
            _fmt(ratios["megatron_tp2_vs_lightning_model_parallel"]),
            _fmt(ratios["megatron_tp2_vs_megatron"]),
        ),
        MODEL_PARALLEL: ("", "1.000 (base)" if "tokens_per_s" in runs[MODEL_PARALLEL] else "", ""),
    }
    headers = (
        "run",
        "procs",
        "ms/step",
        "p10",
        "p90",
        "CPU ms",
        "tokens/s",
        "TFLOP/s/dev",
        "MFU",
        "vs plain",
        "vs Lightning",
        "vs Megatron 1p",
    )
    rows = []
    for name, s in runs.items():
        if "tokens_per_s" not in s:
            rows.append((descriptions[name], s["world_size"], *(["-"] * 7), "", "n/a", ""))
            continue
        rows.append(
            (
                descriptions[name],
                s["world_size"],
                f"{s['median_ms']:.0f}",
                f"{s['p10_ms']:.0f}",
                f"{s['p90_ms']:.0f}",
                f"{s['cpu_median_ms']:.0f}",
                f"{s['tokens_per_s']:,.0f}",
                f"{s['tflops_per_device']:.4f}",
                f"{s['mfu'] * 100:.1f}%",
                *vs[name],
            )
        )
    overhead._print_table(rows, headers)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (warmup included)")
    p.add_argument("--warmup", type=int, default=3, help="first steps of every run left out of the statistics")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every runner, in alternating order (ABBA); statistics pool all repetitions",
    )
    p.add_argument("--metrics-steps", type=int, default=8, help="steps of the MegatronMetrics + CSVLogger run")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=8, help="one microbatch of gbs/dp samples per DP rank")
    p.add_argument(
        "--out",
        default=str(DEFAULT_OUT.relative_to(REPO_ROOT)),
        help="JSON output path (a relative default is under the repository root)",
    )
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 1 or args.metrics_steps <= args.warmup + 1:
        p.error(
            f"--steps ({args.steps}) and --metrics-steps ({args.metrics_steps}) must exceed --warmup "
            f"({args.warmup}) by at least 2"
        )
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.global_batch_size % 2:
        p.error("--global-batch-size must be even (DP2 gives each rank half of it)")
    if args.num_attention_heads % 2:
        p.error("--num-attention-heads must be even (TP2 gives each rank half of the heads)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(overhead.THREADS)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # num_workers=0 is deliberate
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")  # Lightning 2.6 against torch 2.13
    warnings.filterwarnings("ignore", ".*no `validation_step`.*")  # LightningGPT trains only (limit_val_batches=0)
    warnings.filterwarnings("ignore", ".*energy_per_step_j.*")  # MegatronMetrics: no NVML on a CPU
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = ml.GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
    )
    opt_cfg = ml.OptimizerConfig(lr=3e-4, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)
    if os.environ.get(CHILD_RUNNER_ENV) == MODEL_PARALLEL:  # a rank of run_model_parallel
        result = model_parallel_rank(args, config, opt_cfg)
        if result:  # rank 0
            Path(os.environ[RESULT_ENV]).write_text(json.dumps(result))
        return {}

    started = time.perf_counter()
    load_before = list(os.getloadavg())
    peak = measure_matmul_tflops(torch.device("cpu"), torch.float32, min_seconds=0.5)
    print(
        f"megatron-lite throughput benchmark: {config.num_parameters() / 1e6:.2f}M parameters (L={args.num_layers}, "
        f"h={args.hidden_size}, heads={args.num_attention_heads}, s={args.seq_length}, V={args.vocab_size}), "
        f"gbs={args.global_batch_size}, {args.steps} steps ({args.warmup} warmup), torch threads={overhead.THREADS}, "
        f"load average {load_before[0]:.2f}\nCPU peak (measure_matmul_tflops(cpu, fp32), 1 thread): "
        f"{peak:.4f} TFLOP/s, used for every row's MFU",
        flush=True,
    )

    table = runners(args, sys.argv[1:] if argv is None else list(argv), config, opt_cfg)
    descriptions = {name: desc for name, (desc, _, _) in table.items()}
    raw: dict[str, list[dict]] = {name: [] for name in table}
    failed: dict[str, str] = {}
    for rep in range(args.repeats):
        for name in list(table) if rep % 2 == 0 else list(table)[::-1]:  # ABBA: slow drifts hit every row
            if name in failed:
                continue
            t = time.perf_counter()
            try:
                raw[name].append(table[name][2]())
            except Exception as error:  # only the experimental ModelParallelStrategy row may fail: say why
                if name != MODEL_PARALLEL:
                    raise
                failed[name] = f"failed: {type(error).__name__}: {error}"
                print(f"  {descriptions[name]:38s} {failed[name]}", flush=True)
                continue
            print(
                f"  [{rep + 1}/{args.repeats}] {descriptions[name]:38s} median "
                f"{np.median(raw[name][-1]['step_s'][args.warmup :]) * 1e3:6.0f} ms/step "
                f"({time.perf_counter() - t:.1f} s)",
                flush=True,
            )
    runs = {
        name: (
            {"world_size": world, "result": failed[name]}
            if name in failed
            else summarize(raw[name], args, config, world, 2 if name.endswith("tp2") else 1, peak)
        )
        for name, (_, world, _) in table.items()
    }

    callback = metrics_callback_check(args, config, opt_cfg, peak)
    tokens_per_step = args.global_batch_size * args.seq_length

    ratios = ratio_rows(runs)
    cpu_ratios = ratio_rows(runs, "cpu_median_ms")
    reference = runs["plain"]["losses"][0]
    checks = {
        f"max_loss_difference_{name}_vs_plain": max(abs(a - b) for a, b in zip(s["losses"][0], reference))
        for name, s in runs.items()
        if "losses" in s and name != "plain"
    }
    checks["max_loss_difference_megatron_dp2_vs_megatron"] = max(
        abs(a - b) for a, b in zip(runs["megatron_dp2"]["losses"][0], runs["megatron"]["losses"][0])
    )

    print()
    print_report(runs, ratios, descriptions)
    for name, s in runs.items():
        if "result" in s:
            print(f"{descriptions[name]}: {s['result']}")
    print(f"{descriptions[MODEL_PARALLEL]}: {MODEL_PARALLEL_NOTE}")
    print(f"\nratios are of tokens/s (above 1: faster than the baseline). MFU = TFLOP/s per device / {peak:.4f}.")
    print(
        "rank 0's CPU time per step, row / baseline (steadier than wall time on a shared machine): "
        + ", ".join(
            f"{k} {_fmt(cpu_ratios[k])}"
            for k in ("megatron_vs_plain", "megatron_dp2_vs_lightning_ddp", "megatron_tp2_vs_lightning_model_parallel")
        )
    )
    print(
        "max |loss difference| over the first steps (same weights, data and lr; fp32 rounding only): "
        + ", ".join(f"{k.removeprefix('max_loss_difference_')} {v:.1e}" for k, v in checks.items())
    )
    checks["samples_per_rank"] = {name: s["samples_per_rank"] for name, s in runs.items() if "samples_per_rank" in s}
    print(
        f"samples per rank per step (DP ranks get gbs/2 = {args.global_batch_size // 2}, the rest all "
        f"{args.global_batch_size}): " + ", ".join(f"{k} {v}" for k, v in checks["samples_per_rank"].items())
    )
    print_callback_check(callback)
    load_after = list(os.getloadavg())
    print(
        f"total wall time {time.perf_counter() - started:.0f} s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (a shared machine: other jobs move these numbers)"
    )

    result = {
        "benchmark": "throughput",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "lightning": L.__version__,
            "torch_threads": overhead.THREADS,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "config": {
            "args": vars(args),
            "model": asdict(config),
            "optimizer": asdict(opt_cfg),
            "num_parameters": config.num_parameters(),
            "tokens_per_step": tokens_per_step,
            "model_seed": overhead.MODEL_SEED,
            "data_seed": overhead.DATA_SEED,
        },
        "peak_tflops_per_device": peak,
        "runs": {name: {"description": descriptions[name], **s} for name, s in runs.items()},
        "model_parallel_note": MODEL_PARALLEL_NOTE,
        "ratios": ratios,
        "cpu_time_ratios": cpu_ratios,
        "checks": checks,
        "metrics_callback": callback,
    }
    overhead.write_result(result, args.out, DEFAULT_OUT)
    return result


if __name__ == "__main__":
    main()
