#!/usr/bin/env python
"""Checkpoints: training time blocked by an asynchronous save against a synchronous one, save and load
GB/s against ``torch.save`` / ``torch.load`` of the same tensors in one file, and the resharded-load time.

1. **Blocked time.** Two real ``Trainer.fit`` runs of ``GPTModule`` at TP2 (2 fork-launched ranks, one torch
   thread each), identical except ``MegatronStrategy(async_save=...)``, with Lightning's ``ModelCheckpoint``
   saving every ``--save-every`` steps. Rank 0 times each save call (``ModelCheckpoint._save_checkpoint``:
   everything the training thread waits for, including a wait for the previous save) and, at the end of
   ``fit``, the wait for the last background write (reported apart: training is over by then).
   ``blocked ratio`` = async / sync training time blocked by the saves after the first (the first also
   creates the checkpoint process group), summed. Target <= 10 %. The median step time with and without a
   save in flight shows what the background
   write costs the steps it overlaps (on 2 shared CPU cores it competes with training for them).
2. **Bandwidth.** In this process, the full TP1 state of the same model (parameters and AdamW moments):
   ``save_sharded`` (DCP files, CRC-32 while writing, fsync, manifest, atomic commit) against ``torch.save`` of
   the same tensors as one dict into one file followed by ``fsync``; ``load_sharded`` (checksum check, then the
   allow-list DCP read) against ``torch.load(weights_only=True)``. GB/s = tensor bytes / seconds (median of
   ``--repeats``); ratios ours / torch's.
3. **Resharded load.** The checkpoint run 1 wrote at TP2, loaded by a one-process TP1 ``Trainer`` (the
   strategy's ``load_checkpoint``: resolve, verify, DCP read into the TP1 views), against loading a checkpoint
   of the same model written at TP1 (``--repeats`` each, median).

Nothing is asserted; targets are printed as met or missed. Run from the repository root:
``python benchmarks/checkpoint.py [--hidden-size 256 --steps 8 ...]``; JSON in ``benchmarks/results/checkpoint.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; see overhead.py

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import lightning as L  # noqa: E402
import overhead  # noqa: E402  (benchmarks/overhead.py: _restore_environ, _seed, _print_table, write_result)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.checkpoint.format.sharded import load_sharded, save_sharded  # noqa: E402
from megatron_lite.core.checkpoint.state import sharded_model_state, sharded_optimizer_state  # noqa: E402
from megatron_lite.core.parallel.layout import ParallelLayout  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "checkpoint.json"
BLOCKED_TARGET = 0.10


def _config(args) -> ml.GPTConfig:
    return ml.GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
    )


def _data(args) -> MockGPTDataModule:
    return MockGPTDataModule(
        seq_length=args.seq_length,
        micro_batch_size=2,
        global_batch_size=4,
        vocab_size=args.vocab_size,
        seed=overhead.DATA_SEED,
    )


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that records (rank 0) how long each save held the training thread, the end-of-fit wait
    for a background write, and every step's time with whether a save was in flight during it."""

    def __init__(self, out: Path, **kwargs):
        super().__init__(**kwargs)
        self.out, self.saves, self.steps, self.final_wait = out, [], [], 0.0
        self._step_start = 0.0

    def _save_checkpoint(self, trainer, filepath):
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.saves.append(time.perf_counter() - start)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        checkpointer = trainer.strategy.checkpoints.in_use
        self.steps.append(
            [time.perf_counter() - self._step_start, checkpointer is not None and checkpointer.pending is not None]
        )
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module):
        start = time.perf_counter()
        trainer.strategy.wait_for_checkpoint()  # what the strategy's own end-of-fit wait would take
        self.final_wait = time.perf_counter() - start
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"saves": self.saves, "steps": self.steps, "final_wait": self.final_wait}))


def run_training(args, ckpt_dir: Path, *, async_save: bool, tp: int = 2) -> dict:
    with tempfile.TemporaryDirectory(prefix="ml_ckpt_bench_") as tmp, overhead._restore_environ():
        out = Path(tmp) / "rank0.json"
        overhead._seed()
        timer = TimedCheckpoint(out, dirpath=ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1)
        trainer = L.Trainer(
            strategy=ml.MegatronStrategy(
                tensor_model_parallel_size=tp, start_method="fork", log_metrics=False, async_save=async_save
            ),
            accelerator="cpu",
            devices=tp,
            max_steps=args.steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[timer],
        )
        trainer.fit(ml.GPTModule(_config(args), seed=overhead.MODEL_SEED), _data(args))
        return json.loads(out.read_text())


class _TimedLoadStrategy(ml.MegatronStrategy):
    """Records how long ``load_checkpoint`` takes (resolve, verify, read into this layout's views)."""

    load_seconds: list[float] = []

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        start = time.perf_counter()
        result = super().load_checkpoint(checkpoint_path, weights_only)
        self.load_seconds.append(time.perf_counter() - start)
        return result


def time_load_at_tp1(args, checkpoint: Path, step: int) -> float:
    strategy = _TimedLoadStrategy(log_metrics=False)
    strategy.load_seconds = []
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=step + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(ml.GPTModule(_config(args), seed=overhead.MODEL_SEED), _data(args), ckpt_path=str(checkpoint))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return strategy.load_seconds[0]


def bandwidth(args, directory: Path, device: str = "cpu") -> dict:
    """save_sharded/load_sharded against torch.save/torch.load of the same tensors, in this process; the model
    and its AdamW state on ``device`` (on a GPU the saves include the copies to the host)."""
    torch.manual_seed(0)
    module = ml.GPTModule(_config(args), seed=overhead.MODEL_SEED)
    with torch.device(device):
        module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # moments exist and are not zero
    layout = ParallelLayout.single()
    state = {
        "model": sharded_model_state(module, layout),
        "optimizer_0": sharded_optimizer_state(module, optimizer, layout),
    }
    state["optimizer_0"].pop("param_groups")
    flat = {
        f"{group}.{key}": value
        for group, values in state.items()
        for key, value in values.items()
        if torch.is_tensor(value)
    }
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    times: dict[str, list[float]] = {"ours_save": [], "torch_save": [], "ours_load": [], "torch_load": []}
    for i in range(args.repeats):
        target = directory / f"dcp_{i}"
        start = time.perf_counter()
        save_sharded(state, target)
        times["ours_save"].append(time.perf_counter() - start)
        one_file = directory / f"torch_{i}.pt"
        start = time.perf_counter()
        with open(one_file, "wb") as file:
            torch.save(flat, file)
            file.flush()
            os.fsync(file.fileno())
        times["torch_save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        load_sharded(state, target)
        times["ours_load"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(one_file, weights_only=True)
        times["torch_load"].append(time.perf_counter() - start)
    result = {
        name: {
            "seconds": values,
            "median_s": statistics.median(values),
            "gb_per_s": nbytes / statistics.median(values) / 1e9,
        }
        for name, values in times.items()
    }
    result["tensor_bytes"] = nbytes
    result["save_ratio"] = result["ours_save"]["gb_per_s"] / result["torch_save"]["gb_per_s"]
    result["load_ratio"] = result["ours_load"]["gb_per_s"] / result["torch_load"]["gb_per_s"]
    return result


def _blocked(run: dict) -> dict:
    saves = run["saves"][1:]  # the first save also creates the checkpoint process group
    with_write = [s for s, busy in run["steps"] if busy]
    without = [s for s, busy in run["steps"][2:] if not busy]
    return {
        "saves_s": run["saves"],
        "blocked_s": sum(saves),
        "final_wait_s": run["final_wait"],
        "median_save_s": statistics.median(saves) if saves else None,
        "median_step_s_with_write_in_flight": statistics.median(with_write) if with_write else None,
        "median_step_s_without": statistics.median(without) if without else None,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(overhead.THREADS)
    with tempfile.TemporaryDirectory(prefix="ml_ckpt_bench_") as tmp:
        tmp = Path(tmp)
        sync = _blocked(run_training(args, tmp / "sync", async_save=False))
        asynchronous = _blocked(run_training(args, tmp / "async", async_save=True))
        tp2_ckpt = max((tmp / "async").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        step = int(tp2_ckpt.name.split("step=")[1].split(".")[0])
        run_training(args, tmp / "tp1", async_save=False, tp=1)
        tp1_ckpt = tmp / "tp1" / tp2_ckpt.name
        resharded = [time_load_at_tp1(args, tp2_ckpt, step) for _ in range(args.repeats)]
        same = [time_load_at_tp1(args, tp1_ckpt, step) for _ in range(args.repeats)]
        bw = bandwidth(args, tmp / "bandwidth")
        size = sum(f.stat().st_size for f in tp2_ckpt.iterdir())
    ratio = asynchronous["blocked_s"] / sync["blocked_s"]
    result = {
        "config": vars(args),
        "checkpoint_bytes": size,
        "machine": {
            "torch": torch.__version__,
            "lightning": L.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": list(os.getloadavg()),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "blocked": {
            "sync": sync,
            "async": asynchronous,
            "ratio": ratio,
            "target": BLOCKED_TARGET,
            "met": ratio <= BLOCKED_TARGET,
        },
        "bandwidth": bw,
        "resharded_load": {
            "tp2_to_tp1_s": resharded,
            "tp1_to_tp1_s": same,
            "median_tp2_to_tp1_s": statistics.median(resharded),
            "median_tp1_to_tp1_s": statistics.median(same),
        },
    }
    _print(result)
    overhead.write_result(result, args.out, DEFAULT_OUT)
    return result


def _print(r: dict) -> None:
    b, bw, rl = r["blocked"], r["bandwidth"], r["resharded_load"]
    print(
        f"checkpoint: {r['checkpoint_bytes'] / 1e6:.1f} MB on disk at TP2 (model + AdamW moments + RNG), "
        f"load average {', '.join(f'{x:.1f}' for x in r['machine']['load_average'])}"
    )
    saves = len(b["sync"]["saves_s"]) - 1
    rows = [
        (
            f"training blocked by {saves} sync saves",
            f"{b['sync']['blocked_s']:.3f} s",
            f"median {b['sync']['median_save_s']:.3f} s/save",
            "1.000 (baseline)",
        ),
        (
            f"training blocked by {saves} async saves",
            f"{b['async']['blocked_s']:.3f} s",
            f"median {b['async']['median_save_s']:.3f} s/save (+ {b['async']['final_wait_s']:.3f} s at the end of fit)",
            f"{b['ratio']:.3f} vs sync ({'met' if b['met'] else 'missed'}: <= {BLOCKED_TARGET:.2f})",
        ),
        (
            "save: ours (DCP, CRC, fsync, commit)",
            f"{bw['ours_save']['gb_per_s']:.2f} GB/s",
            f"{bw['ours_save']['median_s']:.3f} s",
            f"{bw['save_ratio']:.2f}x torch.save",
        ),
        (
            "save: torch.save one file + fsync",
            f"{bw['torch_save']['gb_per_s']:.2f} GB/s",
            f"{bw['torch_save']['median_s']:.3f} s",
            "1.00 (baseline)",
        ),
        (
            "load: ours (verify + safe DCP read)",
            f"{bw['ours_load']['gb_per_s']:.2f} GB/s",
            f"{bw['ours_load']['median_s']:.3f} s",
            f"{bw['load_ratio']:.2f}x torch.load",
        ),
        (
            "load: torch.load(weights_only=True)",
            f"{bw['torch_load']['gb_per_s']:.2f} GB/s",
            f"{bw['torch_load']['median_s']:.3f} s",
            "1.00 (baseline)",
        ),
        ("load at TP1 of a TP1 checkpoint", f"{rl['median_tp1_to_tp1_s']:.3f} s", "", "1.000 (baseline)"),
        (
            "load at TP1 of a TP2 checkpoint",
            f"{rl['median_tp2_to_tp1_s']:.3f} s",
            "",
            f"{rl['median_tp2_to_tp1_s'] / rl['median_tp1_to_tp1_s']:.3f} vs same layout",
        ),
    ]
    overhead._print_table(rows, ("what", "value", "detail", "ratio"))
    s, a = b["sync"], b["async"]
    if a["median_step_s_with_write_in_flight"] and a["median_step_s_without"]:
        print(
            f"async run: median step {a['median_step_s_with_write_in_flight'] * 1e3:.1f} ms with a background write "
            f"in flight, {a['median_step_s_without'] * 1e3:.1f} ms without (sync run: "
            f"{s['median_step_s_without'] * 1e3:.1f} ms)"
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=24, help="training steps of each blocked-time run")
    p.add_argument("--save-every", type=int, default=6, help="ModelCheckpoint every_n_train_steps")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of the bandwidth and load timings")
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO_ROOT)))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
