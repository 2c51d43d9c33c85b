#!/usr/bin/env python
"""Memory: per-rank optimizer bytes with and without the distributed optimizer, and activation bytes
with and without recomputation. Prints tables and writes JSON (``--out``).

1. **Model + optimizer bytes per parameter** (target: within 5 % of Megatron's formula). bf16 weights
   with fp32 masters (``bf16-true``, Megatron's ``--bf16``), AdamW, DP 1/2/4 on real gloo ranks, after
   one real optimizer step, measured on each rank by summing the bytes of what it holds:
   weights (bf16), gradients (the fp32 main_grad buffers the backward accumulates into), fp32
   master weights and the optimizer state (Adam's two moments; the 0-d step counters count too).
   Formula per parameter: ``2 + 4 + 12 = 18`` without the distributed optimizer and ``6 + 12/dp`` with
   it. The ratio measured / formula is reported per layout (padding of the DP-sharded buckets and
   the step counters make it differ from 1 by a hair).

2. **Activation bytes** of one microbatch's forward (what autograd keeps for the backward: every
   storage saved through ``torch.autograd.graph.saved_tensors_hooks``, counted once, weights
   excluded; see ``megatron_lite/core/estimator/probe.py``), with no recompute, selective (core
   attention) and full (uniform, 1 layer) recomputation, beside the estimator's prediction.

Run from the repository root: ``python benchmarks/memory.py [--out benchmarks/results/memory.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.optim.distributed import DistributedOptimizer  # noqa: E402
from megatron_lite.core.optim.optimizer import MegatronOptimizer  # noqa: E402
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout  # noqa: E402
from megatron_lite.core.parallel.schedules import forward_backward_no_pipelining  # noqa: E402

MODEL = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    vocab_size=4096,
    seq_length=128,
    make_vocab_size_divisible_by=128,
)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure_step_bytes(config: ml.GPTConfig, parallel: ParallelConfig, distributed: bool, rank: int) -> dict:
    """One real optimizer step of ``config`` laid out by ``parallel`` (bf16 weights, fp32 masters, AdamW, one
    microbatch of 2 sequences) on this rank of an initialised process group; the bytes this rank then holds."""
    layout = ParallelLayout.build(parallel, device_type="cpu")
    model = ml.GPTModel(config, layout, seed=1).to(torch.bfloat16)
    cfg = ml.OptimizerConfig(lr=1e-4, lr_decay_style="constant", use_distributed_optimizer=distributed)
    opt = DistributedOptimizer(model, cfg, layout) if distributed else MegatronOptimizer(model, cfg, layout)
    tokens = torch.randint(
        0, config.vocab_size, (2, config.seq_length + 1), generator=torch.Generator().manual_seed(rank)
    )
    opt.zero_grad()
    step = forward_backward_no_pipelining(model, [{"tokens": tokens}], layout, scale_grads=False)
    result = opt.prepare_step(step.grad_scale)
    opt.optimizer.step()
    opt.finish_step(result)
    params = sum(p.numel() for p in model.parameters())
    grads = _bytes(b.buffer for b in opt.grad_buffers.buckets)
    masters = _bytes(s.main_shard for s in opt.shards) if distributed else _bytes(opt.masters.values())
    state = _bytes(v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    row = dict(
        distributed_optimizer=distributed,
        params=params,
        weights_bytes=_bytes(model.parameters()),
        grads_bytes=grads,
        master_bytes=masters,
        optimizer_state_bytes=state,
    )
    row["total_bytes"] = row["weights_bytes"] + grads + masters + state
    layout.destroy()
    return row


def _optimizer_rank(rank: int, world: int, distributed: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    row = dict(dp=world, **measure_step_bytes(ml.GPTConfig(**MODEL), ParallelConfig(), distributed, rank))
    row["bytes_per_param"] = row["total_bytes"] / row["params"]
    row["formula_bytes_per_param"] = 6 + 12 / world if distributed else 18.0
    row["ratio_to_formula"] = row["bytes_per_param"] / row["formula_bytes_per_param"]
    if rank == 0:
        torch.save(row, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def optimizer_rows() -> list[dict]:
    rows = []
    for distributed in (False, True):
        for world in (1, 2, 4):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "row.pt")
                mp.start_processes(_optimizer_rank, args=(world, distributed, out), nprocs=world, start_method="fork")
                rows.append(torch.load(out, weights_only=False))
    return rows


def activation_rows() -> list[dict]:
    from megatron_lite.core.estimator import EstimateLayout, activation_breakdown
    from megatron_lite.core.estimator.probe import measure_activation_bytes

    settings = {
        "none": {},
        "selective": dict(recompute_granularity="selective"),
        "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        # attention dropout forces the math SDPA kernel, which keeps the [b, a, s, s] probabilities:
        # that is what selective recompute is for (flash kernels keep only the log-sum-exp)
        "none+attn_dropout": dict(attention_dropout=0.1),
        "selective+attn_dropout": dict(attention_dropout=0.1, recompute_granularity="selective"),
    }
    rows = []
    tokens = torch.randint(
        0, MODEL["vocab_size"], (2, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0)
    )
    for name, extra in settings.items():
        config = ml.GPTConfig(**MODEL, **extra)
        model = ml.GPTModel(config, seed=1).train()
        measured = measure_activation_bytes(model, lambda: (tokens[:, :-1], tokens[:, 1:]))
        breakdown = activation_breakdown(
            config,
            EstimateLayout(micro_batch_size=2, seq_length=MODEL["seq_length"], precision="32-true", device_type="cpu"),
        )
        # The probe sees what is held at the end of the forward; the estimate's total adds the
        # working set of the one region being recomputed during the backward (its peak).
        held = breakdown.held_after_forward
        rows.append(
            dict(
                recompute=name,
                measured_bytes=measured,
                estimated_bytes=held,
                estimated_peak_bytes=breakdown.total,
                ratio_measured_to_estimate=measured / held,
            )
        )
    for row in rows:
        base = rows[3 if "attn_dropout" in row["recompute"] else 0]["measured_bytes"]
        row["relative_to_no_recompute"] = row["measured_bytes"] / base
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    opt_rows = optimizer_rows()
    print(f"model: {MODEL}, {opt_rows[0]['params']:,} parameters, bf16 weights, fp32 masters, AdamW\n")
    print(
        f"{'optimizer':<12}{'dp':>3}{'weights':>10}{'grads':>10}{'masters':>10}{'adam':>10}"
        f"{'B/param':>9}{'formula':>9}{'ratio':>8}"
    )
    for r in opt_rows:
        mib = 2.0**20
        print(
            f"{'ZeRO-1' if r['distributed_optimizer'] else 'plain':<12}{r['dp']:>3}{r['weights_bytes'] / mib:>9.2f}M"
            f"{r['grads_bytes'] / mib:>9.2f}M{r['master_bytes'] / mib:>9.2f}M{r['optimizer_state_bytes'] / mib:>9.2f}M"
            f"{r['bytes_per_param']:>9.2f}{r['formula_bytes_per_param']:>9.2f}{r['ratio_to_formula']:>8.3f}"
        )
    act_rows = activation_rows()
    print(f"\nactivations of one microbatch (b=2, s={MODEL['seq_length']}, fp32), held at the end of the forward")
    print(f"{'recompute':<24}{'measured':>11}{'estimate':>11}{'meas/est':>10}{'vs none':>9}{'est. peak':>11}")
    for r in act_rows:
        print(
            f"{r['recompute']:<24}{r['measured_bytes'] / 2**20:>10.2f}M{r['estimated_bytes'] / 2**20:>10.2f}M"
            f"{r['ratio_measured_to_estimate']:>10.3f}{r['relative_to_no_recompute']:>9.3f}"
            f"{r['estimated_peak_bytes'] / 2**20:>10.2f}M"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "optimizer": opt_rows, "activations": act_rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
