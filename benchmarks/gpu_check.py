#!/usr/bin/env python
"""One-GPU check: ``tests/gpu``, then the figures of a ~1B-parameter Llama on one GPU, in one short run.

Made for a borrowed GPU and a short slot (about 8 minutes on one H100/H200; ``make gpu-check``). In order:

1. **tests/gpu** in a child ``pytest`` (``--tests-timeout`` seconds at most): passed / failed / skipped, with reasons.
2. **matmul peak**: ``measure_matmul_tflops`` (callbacks/peak_flops.py) of a bf16 ``8192 x 8192`` matmul: the
   denominator of every MFU here (the data-sheet peak is shown beside it).
3. **training step**: a Llama of 16 layers, hidden 2048, 32 heads in 8 query groups, SwiGLU 8192, vocabulary 32000
   (1.10 B parameters), ``bf16-mixed``, AdamW, 2 microbatches of 4 x 2048 tokens: ``GPTModule`` under a real
   ``Trainer(strategy=MegatronStrategy())`` against the same step as a hand-written PyTorch loop
   (benchmarks/overhead.py: same weights, batches, optimizer and autocast), in ABAB order. tokens/s, model TFLOP/s
   (core/estimator/flops.py) and MFU against the measured peak; the overhead ratio; peak memory; the loss difference
   (same model, same data).
4. **attention**: the model's ``CoreAttention`` forward + backward at the training shape, under each SDPA backend
   (torch's default choice, flash, memory-efficient, cuDNN, math), TFLOP/s and ms.
5. **fp8**: one Transformer Engine ``TransformerLayer`` of the same shape, bf16 against ``fp8_autocast`` (skipped with
   the reason when TE does not import or the GPU has no fp8). MegatronStrategy has no fp8 precision yet: this is the
   gain an fp8 path would have at this shape.
6. **recompute**: the training step with ``selective`` and ``full`` (uniform, 1 layer) activation recompute: step
   time and peak memory against none.
7. **distributed optimizer**: the step with ``use_distributed_optimizer=True`` on one rank against the plain one.
8. **generation**: greedy decode tokens/s at batch 1 and 16 (``generate``, KV cache) against ``transformers``'
   ``LlamaForCausalLM.generate`` on the same bf16 weights (benchmarks/generate.py's ``build_weights``).
9. **checkpoint**: save/load GB/s of a model and its AdamW state on the GPU (4 layers of the same width), ours
   (``save_sharded``/``load_sharded``) against ``torch.save``/``torch.load`` (benchmarks/checkpoint.py's
   ``bandwidth``), written under ``build/`` (a disk, not /tmp, which may be memory).

Every section that fails or is skipped says why and the rest still runs; sections are skipped once ``--budget-s``
is spent. Without CUDA (or with ``--cpu-smoke``) everything runs on the CPU at tiny shapes in a few seconds: the
script is not broken, but its figures mean nothing. JSON to ``--out``; a table at the end; timings never asserted.

Run from the repository root: ``python benchmarks/gpu_check.py [--cpu-smoke] [--skip-tests] [--budget-s 480]``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; see overhead.py (a GPU run needs one host thread)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (REPO_ROOT, BENCH_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import lightning as L  # noqa: E402
import overhead  # noqa: E402  (benchmarks/overhead.py: _print_table, write_result)
from gpu_check_sections import (  # noqa: E402
    GPU_SIZES,
    OPTIMIZER,
    PRECISION,
    SECTIONS,
    SMOKE_SIZES,
    Check,
    free_memory,
    run_gpu_tests,
    skipped,
)

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu_check.json"


# --- report -----------------------------------------------------------------------------------------------------
def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _step_row(label: str, s: dict, ratio: str) -> tuple:
    return (
        label,
        f"{s['median_ms']:.1f} ms/step",
        f"{s['tokens_per_s']:,.0f} tokens/s, {s['tflops_per_device']:.3g} TFLOP/s, MFU {s['mfu'] * 100:.1f}%, "
        f"peak {_fmt(s['peak_memory_gib'], '.1f')} GiB",
        ratio,
    )


def table_rows(sections: dict) -> list[tuple]:
    """(what, value, detail, ratio) of every measured section, in the house style of benchmarks/."""
    rows: list[tuple] = []
    get = {name: r for name, r in sections.items() if r.get("status") == "measured"}
    if "tests_gpu" in get:
        t = get["tests_gpu"]
        rows.append(
            ("tests/gpu", f"{len(t['passed'])} passed", f"{len(t['failed'])} failed, {len(t['skipped'])} skipped", "")
        )
    if "matmul_peak" in get:
        m = get["matmul_peak"]
        sheet = m["fraction_of_data_sheet"]
        rows.append(
            (
                "bf16 matmul peak (measured)",
                f"{m['tflops']:.4g} TFLOP/s",
                f"data sheet {_fmt(m['data_sheet_tflops'], '.1f')} TFLOP/s",
                f"{sheet:.2f} of the sheet" if sheet else "",
            )
        )
    if "training" in get:
        t = get["training"]
        rows.append(_step_row("training step: plain PyTorch loop", t["plain"], "1.000 (baseline)"))
        rows.append(
            _step_row("training step: GPTModule + Megatron", t["megatron"], f"{1 + t['overhead']:.3f} vs plain")
        )
    if "attention" in get:
        for name, r in get["attention"]["backends"].items():
            if r["available"]:
                default = get["attention"]["backends"]["default"]
                ratio = f"{r['ms'] / default['ms']:.2f} vs default" if default["available"] else ""
                rows.append(
                    (f"attention fwd+bwd: SDPA {name}", f"{r['ms']:.2f} ms", f"{r['tflops']:.3g} TFLOP/s", ratio)
                )
    if "fp8" in get:
        f = get["fp8"]
        rows.append(
            ("TE layer fwd+bwd: bf16", f"{f['bf16_ms']:.2f} ms", f"{f['bf16_tflops']:.3g} TFLOP/s", "1.00 (baseline)")
        )
        rows.append(
            (
                "TE layer fwd+bwd: fp8",
                f"{f['fp8_ms']:.2f} ms",
                f"{f['fp8_tflops']:.3g} TFLOP/s",
                f"{f['fp8_speedup']:.2f}x faster",
            )
        )
    if "recompute" in get:
        for name in ("selective", "full"):
            r = get["recompute"][name]
            rows.append(_step_row(f"recompute {name}", r[name], f"{r['step_vs_none']:.3f} vs none"))
    if "distributed_optimizer" in get:
        d = get["distributed_optimizer"]
        rows.append(
            _step_row("distributed optimizer, 1 rank", d["distributed"], f"{d['step_vs_none']:.3f} vs plain opt.")
        )
    if "generation" in get:
        g = get["generation"]
        for name, rate in g["tokens_per_s"].items():
            ratio = f"{g['ratios'][name.split(', ')[1]]:.2f}x transformers" if name.startswith("ours") else ""
            rows.append((f"greedy decode: {name}", f"{rate:,.0f} tokens/s", f"{g['new_tokens']} new tokens", ratio))
    if "checkpoint" in get:
        c = get["checkpoint"]
        for ours, theirs, label in (("ours_save", "torch_save", "save"), ("ours_load", "torch_load", "load")):
            rows.append(
                (
                    f"checkpoint {label}: ours / torch",
                    f"{c[ours]['gb_per_s']:.2f} GB/s",
                    f"torch {c[theirs]['gb_per_s']:.2f} GB/s, {c['tensor_bytes'] / 1e9:.2f} GB",
                    f"{c[ours]['gb_per_s'] / c[theirs]['gb_per_s']:.2f}x torch",
                )
            )
    return rows


def not_measured(sections: dict, smoke: bool) -> list[str]:
    """One line per thing this run could not measure, with why."""
    lines = [f"{name}: {r['status']}: {r['reason']}" for name, r in sections.items() if r.get("status") != "measured"]
    if smoke:
        lines[:0] = [
            "every figure: a CPU smoke run at tiny shapes (no CUDA, or --cpu-smoke): none of it is a GPU measurement",
            "peak memory per run: CUDA only (a process's peak RSS never goes down, so it is not one run's)",
        ]
    for name, r in sections.get("attention", {}).get("backends", {}).items():
        if not r["available"]:
            lines.append(f"attention: SDPA {name} unavailable: {r['reason']}")
    if sections.get("tests_gpu", {}).get("failed"):
        lines.append("tests_gpu: failed: " + ", ".join(sections["tests_gpu"]["failed"]))
    return lines


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": L.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "device": str(device),
    }
    for package in ("transformers", "transformer_engine"):
        try:
            info[package] = __import__(package).__version__
        except Exception as error:  # not installed, or broken: the check says which
            info[package] = f"not importable: {type(error).__name__}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}"
        )
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu first")
    p.add_argument("--tests-timeout", type=float, default=240.0, help="seconds tests/gpu may take before it is killed")
    p.add_argument(
        "--budget-s", type=float, default=450.0, help="sections left when this much time is spent are skipped"
    )
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these measurement sections")
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO_ROOT)), help="JSON output path")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """The check; the warning filters and Lightning's log levels it quiets are put back afterwards (a test runs it in
    its own process: left at WARNING, Lightning's INFO lines vanished from every later test of that worker)."""
    import logging

    quiet = ("lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in quiet}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")  # num_workers=0 is deliberate
        warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")  # Lightning 2.6 against torch 2.13
        warnings.filterwarnings("ignore", ".*energy_per_step_j.*")  # MegatronMetrics: no NVML on a CPU
        for name in quiet:
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            return _check(parse_args(argv))
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _check(args) -> dict:
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    smoke = args.cpu_smoke or not cuda
    device = torch.device("cpu" if smoke else "cuda", None if smoke else 0)
    if smoke:
        why = "--cpu-smoke" if args.cpu_smoke else "no CUDA device visible"
        print(f"CPU smoke run ({why}): tiny shapes on the CPU; it proves the script runs, its figures mean nothing")
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    check = Check(device, sizes)
    print(
        f"gpu_check on {device}: model {check.config.num_parameters() / 1e9:.3f} B parameters {sizes.model}, "
        f"{PRECISION}, mbs {sizes.micro_batch_size}, gbs {sizes.global_batch_size}, {sizes.steps} steps "
        f"({sizes.warmup} warm-up) x {sizes.repeats}",
        flush=True,
    )
    sections: dict[str, dict] = {}
    if args.skip_tests:
        sections["tests_gpu"] = skipped("--skip-tests")
    else:
        print("tests/gpu ...", flush=True)
        sections["tests_gpu"] = run_gpu_tests(min(args.tests_timeout, args.budget_s))
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only:
            sections[name] = skipped("not in --only")
            continue
        spent = time.perf_counter() - started
        if spent > args.budget_s:
            sections[name] = skipped(f"time budget spent ({spent:.0f} s of --budget-s {args.budget_s:.0f})")
            continue
        t = time.perf_counter()
        try:
            sections[name] = fn(check)
        except Exception as error:  # a borrowed slot is short: report it and measure the rest
            traceback.print_exc()
            sections[name] = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
        finally:
            free_memory(device)
        sections[name]["seconds"] = time.perf_counter() - t
        print(f"  {name:24s} {sections[name]['status']:8s} ({sections[name]['seconds']:.1f} s)", flush=True)

    print()
    overhead._print_table(table_rows(sections), ("what", "value", "detail", "ratio"))
    missing = not_measured(sections, smoke)
    if "training" in sections and sections["training"].get("status") == "measured":
        difference = sections["training"]["max_loss_difference"]
        print(f"\nmax |loss difference| plain vs GPTModule (same weights and batches): {difference:.1e}")
    print("\nnot measured in this run:" if missing else "\neverything was measured.")
    for line in missing:
        print(f"  - {line}")
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    result = {
        "benchmark": "gpu_check",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "cpu-smoke" if smoke else "gpu",
        "machine": machine(device),
        "config": {
            "args": vars(args),
            "sizes": dataclasses.asdict(sizes),
            "precision": PRECISION,
            "model": dataclasses.asdict(check.config),
            "optimizer": dataclasses.asdict(OPTIMIZER),
        },
        "sections": sections,
        "not_measured": missing,
        "wall_s": time.perf_counter() - started,
    }
    overhead.write_result(result, args.out, DEFAULT_OUT)
    return result


if __name__ == "__main__":
    main()
