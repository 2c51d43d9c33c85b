#!/usr/bin/env python
"""LoRA against full fine-tuning of the same model: trainable parameters, gradient and optimizer bytes per rank,
peak memory and tokens/s, side by side in one run, as ratios.

The same small GPT (``--num-layers`` 4, hidden 256, 8 heads, vocabulary 4096, sequence 128; global batch 4 in
microbatches of 2), the same seeds and mock batches, trained by a real ``lightning.Trainer`` with
``MegatronStrategy`` (ranks forked, also at one rank, so every run starts from a fresh process) for ``--steps``
steps, fp32 weights and AdamW:

* *full*: every parameter trains;
* *LoRA*: ``ml.callbacks.LoRA(dim=--dim, alpha=2 x dim)`` on ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
  ``linear_fc2`` of every layer, the rest frozen;

at one process and at TP2 (``--skip-tp`` skips it). Measured on every rank at the end of training:

* **trainable parameters**: ``requires_grad`` parameters of the rank's model (its TP shard);
* **gradient bytes**: the main-gradient buffers the backward accumulates into (``grad_buffers``), and any
  ``.grad`` outside them, each storage once;
* **optimizer bytes**: the optimizer's live state (Adam's two moments; ZeRO-1 shards / fp32 masters where they
  exist) plus Adam's 0-d step counters -- expected ∝ the adapters' parameters;
* **peak memory**: the rank process's peak resident set size (``ru_maxrss``, what ``MegatronMetrics`` logs as
  ``train/mem_peak_gib`` on CPU), the largest rank's;
* **estimated**: the strategy's start-up estimate (``trainer.strategy.memory_estimate``) of the same run, for the
  gradient and optimizer bytes the estimator predicts (equal, when the estimator counts only the adapters);
* **tokens/s**: ``global_batch x seq_length`` over the median step time (``on_train_batch_start`` ->
  ``on_train_batch_end``, the first ``--warmup`` steps dropped), as ``overhead.py`` measures it.

The first step's loss of LoRA equals full fine-tuning's (``B`` starts at zero: the adapted model starts as the
base) and is printed as a check that both ran the same model on the same data. One torch thread per process.
Never asserted on. Run from the repository root: ``python benchmarks/lora.py [--steps 20 --dim 8 --skip-tp]``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; see overhead.py

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for path in (REPO_ROOT, BENCH_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import lightning as L  # noqa: E402
import overhead  # noqa: E402  (benchmarks/overhead.py: run_framework, _summary, write_result)

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks.metrics import peak_memory_gib  # noqa: E402

MIB = 2**20
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "lora.json"
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (a main parameter's gradient is a view into its buffer)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


class StateBytes(L.Callback):
    """Every rank writes what it holds when training ends: parameters, gradient and optimizer bytes, peak RSS,
    and the strategy's start-up estimate of the same."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, pl_module) -> None:
        opt = pl_module.megatron_optimizer
        params = list(pl_module.model.parameters())
        grads = [b.buffer for b in opt.grad_buffers.buckets] + [p.grad for p in params]
        masters = [s.main_shard for s in getattr(opt, "shards", [])] + list(getattr(opt, "masters", {}).values())
        state = [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        estimate = trainer.strategy.memory_estimate
        row = {
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "weights_bytes": _storage_bytes(params),
            "grads_bytes": _storage_bytes(grads),
            "optimizer_bytes": _storage_bytes(masters) + _storage_bytes(v for v in state if v.ndim),
            "optimizer_step_counter_bytes": _storage_bytes(v for v in state if not v.ndim),
            "peak_rss_bytes": int((peak_memory_gib(torch.device("cpu")) or 0) * 2**30),
            "estimated": None
            if estimate is None
            else {
                "trainable_params": estimate.trainable_params,
                "grads_bytes": estimate.grads_bytes,
                "optimizer_bytes": estimate.optimizer_bytes + estimate.optimizer_host_bytes,
            },
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


def run(config: ml.GPTConfig, args, *, tp: int, lora: bool) -> dict:
    """One fork-launched Trainer run; rank 0's timings with every rank's bytes (``ranks``)."""
    opt_cfg = ml.OptimizerConfig(lr=args.lr, lr_decay_style="constant", weight_decay=0.0)
    with tempfile.TemporaryDirectory(prefix="ml_lora_bench_") as tmp:
        extra: list = [StateBytes(Path(tmp))]
        if lora:
            extra.append(ml.callbacks.LoRA(dim=args.dim, alpha=2.0 * args.dim, target_modules=TARGETS))
        start = time.perf_counter()
        result = overhead.run_framework(
            config, opt_cfg, args, devices=tp, tp=tp, start_method="fork", extra_callbacks=extra
        )
        result["wall_s"] = time.perf_counter() - start
        result["ranks"] = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(tp)]
    return result


def summarize(raw: dict, args) -> dict:
    summary = overhead._summary([raw], args.warmup, args.global_batch_size * args.seq_length)
    ranks = raw["ranks"]
    for key in ("params", "trainable_params", "weights_bytes", "grads_bytes", "optimizer_bytes", "peak_rss_bytes"):
        summary[key] = max(r[key] for r in ranks)  # the most loaded rank
    summary["optimizer_bytes"] += max(r["optimizer_step_counter_bytes"] for r in ranks)
    summary["estimated"] = ranks[0]["estimated"]
    summary["ranks"] = ranks
    summary["first_loss"] = raw["losses"][0]
    summary["wall_s"] = raw["wall_s"]
    return summary


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dim", type=int, default=8, help="LoRA rank (alpha = 2 x dim)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--skip-tp", action="store_true", help="one process only (no TP2 rows)")
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO_ROOT)))
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = ml.GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
    )
    load_before = os.getloadavg()
    layouts = [1] if args.skip_tp else [1, 2]
    runs: dict = {}
    for tp in layouts:
        for lora in (False, True):
            name = f"{'lora' if lora else 'full'}_tp{tp}"
            print(f"running {name} ...", flush=True)
            runs[name] = summarize(run(config, args, tp=tp, lora=lora), args)

    headers = (
        "run",
        "trainable",
        "grads MiB",
        "optimizer MiB",
        "est. grads+opt MiB",
        "peak RSS MiB",
        "ms/step",
        "tokens/s",
    )
    rows, ratios = [], {}
    for name, s in runs.items():
        est = s["estimated"]
        rows.append(
            (
                name,
                f"{s['trainable_params']:,}",
                f"{s['grads_bytes'] / MIB:.2f}",
                f"{s['optimizer_bytes'] / MIB:.2f}",
                "-" if est is None else f"{(est['grads_bytes'] + est['optimizer_bytes']) / MIB:.2f}",
                f"{s['peak_rss_bytes'] / MIB:.0f}",
                f"{s['median_ms']:.1f}",
                f"{s['tokens_per_s']:,.0f}",
            )
        )
    print(f"\nmodel: {runs['full_tp1']['params']:,} parameters, fp32, AdamW; LoRA dim {args.dim} on {TARGETS}\n")
    overhead._print_table(rows, headers)
    print("\nLoRA / full fine-tuning (per rank; tokens/s above 1: LoRA faster):")
    for tp in layouts:
        full, lora = runs[f"full_tp{tp}"], runs[f"lora_tp{tp}"]
        ratio = {
            "trainable_params": lora["trainable_params"] / full["trainable_params"],
            "grads_bytes": lora["grads_bytes"] / full["grads_bytes"],
            "optimizer_bytes": lora["optimizer_bytes"] / full["optimizer_bytes"],
            "optimizer_bytes_per_trainable_param": lora["optimizer_bytes"] / lora["trainable_params"],
            "full_optimizer_bytes_per_trainable_param": full["optimizer_bytes"] / full["trainable_params"],
            "peak_rss": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
            "tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"],
            "first_loss_difference": abs(lora["first_loss"] - full["first_loss"]),
            "estimate_equals_measured": all(
                r["estimated"] is not None
                and (r["estimated"]["grads_bytes"], r["estimated"]["optimizer_bytes"])
                == (r["grads_bytes"], r["optimizer_bytes"] + r["optimizer_step_counter_bytes"])
                for r in (*full["ranks"], *lora["ranks"])
            ),
        }
        ratios[f"tp{tp}"] = ratio
        print(
            f"  TP{tp}: trainable {ratio['trainable_params']:.4f}, gradients {ratio['grads_bytes']:.4f}, optimizer "
            f"{ratio['optimizer_bytes']:.4f} ({ratio['optimizer_bytes_per_trainable_param']:.2f} B per trainable "
            f"parameter; full {ratio['full_optimizer_bytes_per_trainable_param']:.2f}), peak RSS "
            f"{ratio['peak_rss']:.3f}, tokens/s {ratio['tokens_per_s']:.3f}; first-step loss difference "
            f"{ratio['first_loss_difference']:.1e}; start-up estimate = measured gradient and optimizer bytes on "
            f"every rank: {ratio['estimate_equals_measured']}"
        )
    result = {
        "config": vars(args),
        "targets": TARGETS,
        "machine": {
            "torch": torch.__version__,
            "lightning": L.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "runs": runs,
        "ratios": ratios,
    }
    overhead.write_result(result, args.out, DEFAULT_OUT)
    return result


if __name__ == "__main__":
    main()
