#!/usr/bin/env python
"""Mixture-of-Experts performance, side by side in one run, as ratios. Prints tables and writes JSON (``--out``).

The model: a GPT whose every layer is an MoE (``--num-experts`` 8 experts of width ``--moe-ffn-hidden-size`` 512,
top-``--topk`` 2 softmax routing, aux loss 1e-2), h=256, 4 layers, s=128, V=4096, fp32, one torch thread per rank,
on 2 forked gloo ranks unless said. Timings are never asserted on.

1. **EP2 against EP1**: real ``Trainer`` runs of ``GPTModule`` on ``MockGPTDataModule``, 2 ranks fork-launched,
   ``MegatronStrategy(expert_model_parallel_size=2)`` (the experts folded into DP2: each rank holds 4 of the 8)
   against ``expert_model_parallel_size=1`` (plain DP2, every rank all 8); and at EP2 the ``allgather`` against the
   ``alltoall`` dispatcher and ``moe_grouped_gemm=True`` against the per-expert loop. Median step time of rank 0
   (``overhead.StepTimer``), tokens/s of the global batch; the runs alternate order over ``--repeats``. Same seeds
   and data: the losses agree (printed).
   **1b.** The same four, step-interleaved: on 2 forked ranks, one ``TrainingEngine`` (the engine ``GPTModule`` runs)
   per run over the same batches, one optimizer step of each in turn, so the machine's noise hits all four alike;
   wall and CPU time of rank 0.
2. **One MoE layer, forward + backward** at EP2: allgather, alltoall and alltoall with grouped GEMM, iterations
   interleaved so that machine noise hits each alike (both ranks start each iteration together).
3. **Bytes each rank sends per step** for each dispatcher: one real training step (``forward_backward_no_pipelining``,
   every microbatch) under :class:`~megatron_lite.core.parallel.collective_bytes.CollectiveBytes`, which counts the
   payload of every c10d collective on the dispatcher's process groups, token rows and routing metadata apart;
   the dispatchers' ``sent_bytes`` (summed over the step's forwards) beside it; against the theory per MoE layer and
   microbatch, forward and backward alike: allgather ``2 (EP x ETP - 1) T H`` bytes, alltoall
   ``2 top-k T H (EP - 1) / EP`` under uniform routing (T tokens per rank, H hidden, fp32).
4. **A peer**: megatron-core's ``MoELayer`` (0.16.1, ``SequentialMLP`` experts, both dispatchers) on CPU in one
   process, with our router and expert weights copied in: max |difference| of the outputs and gradients, and our
   layer's time (loop and grouped GEMM) over theirs. Four in-process patches let it run on CPU, each with its
   reason in ``benchmarks/moe_peer.py``.
5. **Memory**: per-rank parameter, gradient and optimizer bytes measured after one real step (bf16 weights, fp32
   masters, AdamW, plain and ZeRO-1; ``memory.measure_step_bytes``) at EP1 and EP2 against the estimator
   (``estimate_for_run``).

Run from the repository root: ``python benchmarks/moe.py [--steps 20 --repeats 1 ...]`` (1.5 minutes on 2 quiet cores).
"""

from __future__ import annotations

import os

# Before torch is imported: one OpenMP thread (and Lightning's launchers then leave the thread count alone).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import memory  # noqa: E402  (benchmarks/memory.py: measure_step_bytes)
import moe_peer  # noqa: E402  (benchmarks/moe_peer.py: megatron-core's MoELayer on CPU)
import overhead  # noqa: E402  (benchmarks/overhead.py: run_framework, StepTimer, _summary, _print_table, ...)

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.engine import TrainingEngine  # noqa: E402
from megatron_lite.core.estimator import estimate_for_run  # noqa: E402
from megatron_lite.core.optim.optimizer import MegatronOptimizer  # noqa: E402
from megatron_lite.core.parallel.collective_bytes import CollectiveBytes  # noqa: E402
from megatron_lite.core.parallel.geometry import DataGeometry  # noqa: E402
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout  # noqa: E402
from megatron_lite.core.parallel.run_spec import RunSpec  # noqa: E402
from megatron_lite.core.parallel.schedules import (  # noqa: E402
    forward_backward_no_pipelining,
    gpt_forward_step,
    gpt_loss,
    masked_token_loss,
)

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "moe.json"
WORLD = 2
# name: (expert_model_parallel_size, moe_token_dispatcher_type, moe_grouped_gemm)
TRAINER_RUNS = {
    "EP1 alltoall": (1, "alltoall", False),
    "EP2 alltoall": (2, "alltoall", False),
    "EP2 allgather": (2, "allgather", False),
    "EP2 alltoall grouped": (2, "alltoall", True),
}
# constant lr: the runs' losses stay comparable step by step
OPTIMIZER = ml.OptimizerConfig(lr=3e-4, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)
LAYER_VARIANTS = {
    "allgather": ("allgather", False),
    "alltoall": ("alltoall", False),
    "alltoall grouped": ("alltoall", True),
}


def moe_config(args, dispatcher: str = "alltoall", grouped: bool = False, num_layers=None) -> ml.GPTConfig:
    return ml.GPTConfig(
        num_layers=num_layers or args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
    )


# --- forked ranks ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, fn: Callable, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(fn(rank, world, args)))
    finally:
        dist.destroy_process_group()


def on_ranks(fn: Callable, world: int, args) -> list:
    """``fn(rank, world, args)`` on ``world`` forked gloo ranks; every rank's (JSON) result."""
    with tempfile.TemporaryDirectory(prefix="ml_moe_") as tmp, overhead._restore_environ():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        mp.start_processes(_rank_main, args=(world, fn, args, tmp), nprocs=world, start_method="fork")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _moe_layer(model: ml.GPTModel, index: int = 0):
    return model.layers[str(index)].mlp


def _time_interleaved(steps: dict, iters: int, warmup: int, barrier: bool) -> tuple[dict, dict]:
    """Run each of ``steps`` (name -> callable) once per iteration, in turn; the median wall and CPU (this
    process's) milliseconds over the timed iterations. CPU time leaves out what other jobs on the machine take
    from this process, and also the waits inside collectives."""
    wall: dict = {name: [] for name in steps}
    cpu: dict = {name: [] for name in steps}
    for it in range(warmup + iters):
        for name, step in steps.items():
            if barrier:
                dist.barrier()  # the ranks start together: a collective's wait is not the previous step's lag
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            if it >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
    median = lambda times: {name: float(np.median(t)) * 1e3 for name, t in times.items()}  # noqa: E731
    return median(wall), median(cpu)


def _forward_backward(layer, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step():
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out = out[0] if isinstance(out, tuple) else out  # megatron-core's returns (output, bias)
        (out * grad).sum().backward()
        return inputs.grad

    return step


# --- 1b: the same four runs step-interleaved on the training engine -----------------------------------------
class _GPTObjective:
    """GPTModule's objective (the next-token loss) for a bare engine."""

    def forward_step(self, part, microbatch, input_tensor):
        return gpt_forward_step(part, microbatch, input_tensor)

    def loss(self, output, microbatch):
        return masked_token_loss(output, microbatch)


def _interleaved_rank(rank: int, world: int, args) -> dict:
    layouts = {ep: ParallelLayout.build(ParallelConfig(expert_model_parallel_size=ep), "cpu") for ep in (1, world)}
    gen = torch.Generator().manual_seed(rank)  # the same batches for every run: the losses must agree
    shape = (args.micro_batch_size, args.seq_length + 1)
    per_rank = args.global_batch_size // (args.micro_batch_size * world)
    batches = [
        [{"tokens": torch.randint(0, args.vocab_size, shape, generator=gen)} for _ in range(per_rank)]
        for _ in range(args.steps)
    ]
    losses: dict = {name: [] for name in TRAINER_RUNS}

    def runner(name: str, ep: int, dispatcher: str, grouped: bool) -> Callable[[], None]:
        layout = layouts[ep]
        model = ml.GPTModel(moe_config(args, dispatcher, grouped), layout, seed=overhead.MODEL_SEED).train()
        engine = TrainingEngine(model, layout, _GPTObjective(), MegatronOptimizer(model, OPTIMIZER, layout))
        steps = iter(batches)

        def step() -> None:
            losses[name].append(float(engine.train_step(next(steps))[0].loss))

        return step

    runners = {name: runner(name, *spec) for name, spec in TRAINER_RUNS.items()}
    step_ms, step_cpu_ms = _time_interleaved(runners, args.steps - args.warmup, args.warmup, barrier=True)
    for layout in layouts.values():
        layout.destroy()
    return dict(step_ms=step_ms, step_cpu_ms=step_cpu_ms, losses=losses)


# --- 2 + 3: one layer's time, and the bytes of a step, on 2 ranks at EP2 ------------------------------------
def _ep2_rank(rank: int, world: int, args) -> dict:
    layout = ParallelLayout.build(ParallelConfig(expert_model_parallel_size=world), device_type="cpu")
    gen = torch.Generator().manual_seed(rank)  # each rank its own tokens, as data parallelism gives them
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    models = {
        name: ml.GPTModel(moe_config(args, dispatcher, grouped), layout, seed=overhead.MODEL_SEED).train()
        for name, (dispatcher, grouped) in LAYER_VARIANTS.items()
    }
    steps = {name: _forward_backward(_moe_layer(model), x, grad) for name, model in models.items()}
    layer_ms, layer_cpu_ms = _time_interleaved(steps, args.layer_iters, 3, barrier=True)

    microbatches = [
        {"tokens": torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)}
        for _ in range(args.global_batch_size // (args.micro_batch_size * world))
    ]
    traffic = {name: _step_traffic(models[name], layout, microbatches, args) for name in ("allgather", "alltoall")}
    layout.destroy()
    return dict(layer_ms=layer_ms, layer_cpu_ms=layer_cpu_ms, traffic=traffic)


def _step_traffic(model: ml.GPTModel, layout: ParallelLayout, microbatches: list, args) -> dict:
    """One training step's collectives on the dispatcher's groups (the step, and its forwards apart), and the
    dispatchers' own ``sent_bytes`` summed over the forwards."""
    groups = {g.group_name for g in (layout.group(k) for k in ("ep_etp", "ep", "etp")) if g is not None}
    seen = dict(attribute=0, remote=0, routed=0)

    def after_forward(layer, inputs, output):
        d = layer.dispatcher
        seen["attribute"] += d.sent_bytes
        if hasattr(d, "input_splits"):  # alltoall: the (token, expert) pairs sent to the other EP rank
            seen["remote"] += sum(d.input_splits) - d.input_splits[d.ep_rank]
            seen["routed"] += sum(d.input_splits)

    hooks = [_moe_layer(model, i).register_forward_hook(after_forward) for i in range(args.num_layers)]
    forward = CollectiveBytes()

    def counted_forward(model, microbatch):
        with forward:  # nested in `step` below: both count the forward's collectives
            return gpt_loss(model, microbatch)

    with CollectiveBytes() as step:
        forward_backward_no_pipelining(model, microbatches, layout, loss_fn=counted_forward)
    for hook in hooks:
        hook.remove()
    on_groups = [r for r in step.records if r.group in groups]
    return dict(
        counted_bytes=sum(r.sent_bytes for r in on_groups),
        token_row_bytes=sum(r.sent_bytes for r in on_groups if r.row_width == args.hidden_size),
        forward_counted_bytes=forward.total(groups),
        sent_bytes_attribute=seen["attribute"],
        other_groups_bytes=step.total() - step.total(groups),
        unknown=step.unknown,
        remote_pairs=seen["remote"],
        routed_pairs=seen["routed"],
        microbatches=len(microbatches),
    )


def traffic_theory(args, dispatcher: str, microbatches: int, ep: int = WORLD, etp: int = 1) -> float:
    """Token-row bytes one rank sends per step: per MoE layer and microbatch, dispatch + combine, forward and
    backward alike (uniform routing for alltoall)."""
    tokens, row = args.seq_length * args.micro_batch_size, args.hidden_size * 4
    per_direction = (
        (ep * etp - 1) * tokens * row if dispatcher == "allgather" else args.topk * tokens * row * (ep - 1) / ep
    )
    return 2 * 2 * per_direction * args.num_layers * microbatches


# --- 4: megatron-core's MoELayer on CPU (benchmarks/moe_peer.py) -------------------------------------------
def _peer_rank(rank: int, world: int, args) -> dict:
    try:
        parallel_state = moe_peer.import_megatron()
    except Exception as error:  # reported as what blocks the peer; the rest of the benchmark runs
        return dict(blocked=f"megatron-core does not import: {type(error).__name__}: {error}")
    parallel_state.initialize_model_parallel(1, 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    steps, checks = {}, {}
    with moe_peer.megatron_on_cpu():
        for dispatcher in ("alltoall", "allgather"):
            ours, grouped = (
                _moe_layer(ml.GPTModel(moe_config(args, dispatcher, g, num_layers=1), seed=1)).train()
                for g in (False, True)
            )
            theirs = moe_peer.megatron_moe_layer(ours, args, dispatcher)
            for name, layer in {"ours": ours, "ours grouped": grouped, "megatron-core": theirs}.items():
                steps[f"{name}, {dispatcher}"] = _forward_backward(layer, x, grad)
            checks[dispatcher] = moe_peer.compare(ours, theirs, x, grad)
        layer_ms, layer_cpu_ms = _time_interleaved(steps, args.layer_iters, 3, barrier=False)
    parallel_state.destroy_model_parallel()
    return dict(layer_ms=layer_ms, layer_cpu_ms=layer_cpu_ms, checks=checks)


# --- 5: memory ---------------------------------------------------------------------------------------
def memory_rows(args) -> list:
    rows = []
    for distributed in (False, True):
        for ep in (1, WORLD):
            config, parallel = moe_config(args), ParallelConfig(expert_model_parallel_size=ep)

            def measure(rank, world, args, config=config, parallel=parallel, distributed=distributed):
                return memory.measure_step_bytes(config, parallel, distributed, rank)

            measured = on_ranks(measure, WORLD, args)[0]
            run = RunSpec(
                parallel,
                world_size=WORLD,
                data=DataGeometry(micro_batch_size=2, global_batch_size=2 * WORLD, seq_length=args.seq_length),
                precision="bf16-true",
            )
            optimizer = ml.OptimizerConfig(use_distributed_optimizer=distributed)
            estimate = estimate_for_run(config, run, optimizer, device_type="cpu")
            rows.append(
                dict(
                    ep=ep,
                    measured=measured,
                    estimate=dict(
                        params=estimate.params,
                        weights_bytes=estimate.weights_bytes,
                        grads_bytes=estimate.grads_bytes,
                        optimizer_bytes=estimate.optimizer_bytes + estimate.optimizer_host_bytes,
                        knows_experts=hasattr(estimate, "expert_params"),
                    ),
                )
            )
    return rows


# --- report ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per Trainer run (warmup included)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of every Trainer run left out")
    p.add_argument("--repeats", type=int, default=1, help="repetitions of the Trainer runs, alternating their order")
    p.add_argument("--layer-iters", type=int, default=20, help="timed forward+backward passes per layer variant")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    for part in ("trainer", "interleaved", "layers", "peer", "memory"):
        p.add_argument(f"--skip-{part}", action="store_true", help=f"leave out the {part} comparison")
    p.add_argument(
        "--out",
        default=str(DEFAULT_OUT.relative_to(REPO_ROOT)),
        help="JSON output path (a relative default is under the repository root)",
    )
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 1:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 2")
    if args.global_batch_size % (args.micro_batch_size * WORLD):
        p.error(f"--global-batch-size must be a multiple of --micro-batch-size x {WORLD} ranks")
    if args.num_experts % WORLD:
        p.error(f"--num-experts must be a multiple of EP = {WORLD}")
    return args


def trainer_section(args, result: dict) -> None:
    def runner(ep: int, dispatcher: str, grouped: bool):
        return lambda: overhead.run_framework(
            moe_config(args, dispatcher, grouped),
            OPTIMIZER,
            args,
            devices=WORLD,
            start_method="fork",
            strategy_kwargs=dict(expert_model_parallel_size=ep),
        )

    raw: dict = {}
    overhead._alternating(
        tuple(TRAINER_RUNS), {k: runner(*v) for k, v in TRAINER_RUNS.items()}, args.repeats, args.warmup, raw
    )
    runs = {k: overhead._summary(v, args.warmup, args.global_batch_size * args.seq_length) for k, v in raw.items()}
    base = {"EP2 alltoall": "EP1 alltoall", "EP2 allgather": "EP2 alltoall", "EP2 alltoall grouped": "EP2 alltoall"}
    rows = [
        overhead._row(
            name,
            runs[name],
            f"step {runs[name]['median_ms'] / runs[base[name]]['median_ms']:.3f} x {base[name]}"
            if name in base
            else "baseline",
        )
        for name in TRAINER_RUNS
    ]
    print("\n1. Trainer, 2 ranks (DP2), rank 0's step")
    overhead._print_table(rows, ("run", "median ms/step", "p10", "p90", "tokens/s", "ratio"))
    losses = {k: max(overhead._max_loss_diff(runs["EP1 alltoall"], runs[k]), 0.0) for k in TRAINER_RUNS}
    print("max |loss difference| against EP1 alltoall: " + ", ".join(f"{k} {v:.1e}" for k, v in losses.items()))
    ratios = dict(
        ep2_vs_ep1_tokens_per_s=runs["EP2 alltoall"]["tokens_per_s"] / runs["EP1 alltoall"]["tokens_per_s"],
        allgather_vs_alltoall_step=runs["EP2 allgather"]["median_ms"] / runs["EP2 alltoall"]["median_ms"],
        grouped_vs_loop_step=runs["EP2 alltoall grouped"]["median_ms"] / runs["EP2 alltoall"]["median_ms"],
    )
    print(
        f"EP2 / EP1 tokens/s {ratios['ep2_vs_ep1_tokens_per_s']:.3f}; allgather / alltoall step time "
        f"{ratios['allgather_vs_alltoall_step']:.3f}; grouped GEMM / loop step time "
        f"{ratios['grouped_vs_loop_step']:.3f}"
    )
    result["trainer"] = dict(runs=runs, ratios=ratios, max_loss_difference=losses)


def interleaved_section(args, result: dict) -> None:
    rank0 = on_ranks(_interleaved_rank, WORLD, args)[0]
    ms, cpu, tokens = rank0["step_ms"], rank0["step_cpu_ms"], args.global_batch_size * args.seq_length
    base = {"EP2 alltoall": "EP1 alltoall", "EP2 allgather": "EP2 alltoall", "EP2 alltoall grouped": "EP2 alltoall"}
    print(
        f"\n1b. the same, step-interleaved on the training engine (TrainingEngine.train_step, one step of each run "
        f"in turn, {args.steps - args.warmup} timed), rank 0"
    )
    rows = [
        (
            name,
            f"{v:.1f}",
            f"{tokens / (v / 1e3):,.0f}",
            f"{v / ms[base[name]]:.3f} x {base[name]}" if name in base else "baseline",
            f"{cpu[name]:.1f}",
            f"{cpu[name] / cpu[base[name]]:.3f}" if name in base else "baseline",
        )
        for name, v in ms.items()
    ]
    overhead._print_table(rows, ("run", "median ms/step", "tokens/s", "step ratio", "CPU ms/step", "CPU ratio"))
    reference = rank0["losses"]["EP1 alltoall"]
    losses = {k: max(abs(a - b) for a, b in zip(reference, v)) for k, v in rank0["losses"].items()}
    print("max |loss difference| against EP1 alltoall: " + ", ".join(f"{k} {v:.1e}" for k, v in losses.items()))
    ratios = dict(
        ep2_vs_ep1_tokens_per_s=ms["EP1 alltoall"] / ms["EP2 alltoall"],
        allgather_vs_alltoall_step=ms["EP2 allgather"] / ms["EP2 alltoall"],
        grouped_vs_loop_step=ms["EP2 alltoall grouped"] / ms["EP2 alltoall"],
        ep2_vs_ep1_cpu=cpu["EP2 alltoall"] / cpu["EP1 alltoall"],
        allgather_vs_alltoall_cpu=cpu["EP2 allgather"] / cpu["EP2 alltoall"],
        grouped_vs_loop_cpu=cpu["EP2 alltoall grouped"] / cpu["EP2 alltoall"],
    )
    print(
        f"EP2 / EP1 tokens/s {ratios['ep2_vs_ep1_tokens_per_s']:.3f}; allgather / alltoall step time "
        f"{ratios['allgather_vs_alltoall_step']:.3f}; grouped GEMM / loop step time "
        f"{ratios['grouped_vs_loop_step']:.3f}"
    )
    result["interleaved"] = dict(
        step_ms=ms, step_cpu_ms=cpu, ratios=ratios, losses=rank0["losses"], max_loss_difference=losses
    )


def layers_section(args, result: dict) -> None:
    ranks = on_ranks(_ep2_rank, WORLD, args)
    ms, cpu = ranks[0]["layer_ms"], ranks[0]["layer_cpu_ms"]
    print(
        f"\n2. one MoE layer, forward + backward, EP2 on 2 ranks "
        f"({args.seq_length}x{args.micro_batch_size} tokens per rank), rank 0"
    )
    overhead._print_table(
        [
            (name, f"{v:.2f}", f"{v / ms['alltoall']:.3f}", f"{cpu[name]:.2f}", f"{cpu[name] / cpu['alltoall']:.3f}")
            for name, v in ms.items()
        ],
        ("dispatcher", "median ms", "x alltoall", "CPU ms", "CPU x alltoall"),
    )
    print(
        f"\n3. bytes each rank sends per step ({ranks[0]['traffic']['alltoall']['microbatches']} microbatches x "
        f"{args.num_layers} MoE layers, forward + backward)"
    )
    rows, traffic = [], {}
    for name in ("allgather", "alltoall"):
        theory = traffic_theory(args, name, ranks[0]["traffic"][name]["microbatches"])
        for rank, r in enumerate(ranks):
            t = r["traffic"][name]
            t["theory_token_row_bytes"] = theory
            t["measured_over_theory"] = t["token_row_bytes"] / theory
            t["attribute_equals_counted_forward"] = t["sent_bytes_attribute"] == t["forward_counted_bytes"]
            traffic[f"{name} rank {rank}"] = t
            rows.append(
                (
                    f"{name}, rank {rank}",
                    f"{t['counted_bytes'] / 2**20:.2f}",
                    f"{t['token_row_bytes'] / 2**20:.2f}",
                    f"{(t['counted_bytes'] - t['token_row_bytes']) / 2**10:.1f}",
                    f"{t['sent_bytes_attribute'] / 2**20:.2f}"
                    + (" =" if t["attribute_equals_counted_forward"] else " !="),
                    f"{theory / 2**20:.2f}",
                    f"{t['measured_over_theory']:.3f}",
                )
            )
    overhead._print_table(
        rows,
        (
            "dispatcher",
            "counted MiB",
            "token rows MiB",
            "routing KiB",
            "sent_bytes MiB (fwd)",
            "theory MiB",
            "rows / theory",
        ),
    )
    a2a = [r["traffic"]["alltoall"] for r in ranks]
    share = sum(t["remote_pairs"] for t in a2a) / max(sum(t["routed_pairs"] for t in a2a), 1)
    print(
        f"sent_bytes (the dispatchers' attribute, summed over the step's forwards) '=' the counted forward: "
        f"{all(t['attribute_equals_counted_forward'] for t in traffic.values())}; alltoall: {share:.3f} of the routed "
        f"(token, expert) pairs went to the other rank (uniform routing: {(WORLD - 1) / WORLD:.3f}); other groups "
        f"(the loss's all-reduce): {ranks[0]['traffic']['alltoall']['other_groups_bytes']} B"
    )
    result["layers"] = dict(
        layer_ms=ms,
        layer_cpu_ms=cpu,
        ratios={k: v / ms["alltoall"] for k, v in ms.items()},
        cpu_ratios={k: v / cpu["alltoall"] for k, v in cpu.items()},
    )
    result["traffic"] = dict(per_rank=traffic, alltoall_remote_share=share)


def peer_section(args, result: dict) -> None:
    peer = on_ranks(_peer_rank, 1, args)[0]
    result["peer"] = peer
    print(
        f"\n4. megatron-core {moe_peer.megatron_version()} MoELayer beside ours, one process, forward + backward, "
        f"{args.seq_length}x{args.micro_batch_size} tokens"
    )
    if "blocked" in peer:
        print(f"   not run: {peer['blocked']}")
        return
    ms, cpu = peer["layer_ms"], peer["layer_cpu_ms"]
    rows = []
    for dispatcher in ("alltoall", "allgather"):
        ref = f"megatron-core, {dispatcher}"
        for name in (f"ours, {dispatcher}", f"ours grouped, {dispatcher}", ref):
            rows.append((name, f"{ms[name]:.2f}", f"{ms[name] / ms[ref]:.3f}", f"{cpu[name] / cpu[ref]:.3f}"))
    overhead._print_table(rows, ("layer", "median ms", "x megatron-core", "CPU x megatron-core"))
    for dispatcher, c in peer["checks"].items():
        print(
            f"max |ours - megatron-core|, {dispatcher}: output {c['output']:.1e} (of {c['output_scale']:.2f}), "
            f"input grad {c['input_grad']:.1e}, router grad {c['router_grad']:.1e}, "
            f"expert grads {c['expert_grads']:.1e}"
        )
    peer["ratios"] = {k: v / ms[f"megatron-core, {k.rsplit(', ', 1)[1]}"] for k, v in ms.items()}


def memory_section(args, result: dict) -> None:
    rows = memory_rows(args)
    print("\n5. per-rank bytes after one step (bf16 weights, fp32 grads and masters, AdamW), 2 ranks, MiB")
    table = []
    for r in rows:
        m, e = r["measured"], r["estimate"]
        measured_opt = m["master_bytes"] + m["optimizer_state_bytes"]
        table.append(
            (
                f"EP{r['ep']}, {'ZeRO-1' if m['distributed_optimizer'] else 'plain'}",
                f"{m['params'] / 1e6:.2f}M / {e['params'] / 1e6:.2f}M",
                f"{m['weights_bytes'] / 2**20:.2f} / {e['weights_bytes'] / 2**20:.2f}",
                f"{m['grads_bytes'] / 2**20:.2f} / {e['grads_bytes'] / 2**20:.2f}",
                f"{measured_opt / 2**20:.2f} / {e['optimizer_bytes'] / 2**20:.2f}",
                f"{m['total_bytes'] / (e['weights_bytes'] + e['grads_bytes'] + e['optimizer_bytes']):.3f}",
            )
        )
    overhead._print_table(table, ("layout", "params meas./est.", "weights", "grads", "optimizer", "total meas./est."))
    if not all(r["estimate"]["knows_experts"] for r in rows):
        print(
            "note: the estimator does not know experts yet (its estimate has no expert_params): it counts a dense MLP "
            "of ffn_hidden_size per layer and no router, so its numbers are not the MoE's"
        )
    result["memory"] = rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", ".*energy_per_step_j.*")  # no energy counter on this machine
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # counted on the model (GPTConfig.num_parameters may not count experts): a token goes through top-k of them
    model = ml.GPTModel(moe_config(args), seed=1)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * args.topk // args.num_experts
    del model
    started = time.perf_counter()
    print(
        f"megatron-lite MoE benchmark: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active), "
        f"{args.num_layers} MoE layers "
        f"of {args.num_experts} experts (top-{args.topk}, width {args.moe_ffn_hidden_size}), h={args.hidden_size}, "
        f"s={args.seq_length}, mbs={args.micro_batch_size}, gbs={args.global_batch_size}, {WORLD} ranks, fp32, "
        f"one thread per rank",
        flush=True,
    )
    result: dict = {"benchmark": "moe", "args": vars(args), "parameters": total, "active_parameters": active}
    sections = dict(
        trainer=trainer_section,
        interleaved=interleaved_section,
        layers=layers_section,
        peer=peer_section,
        memory=memory_section,
    )
    for name, section in sections.items():
        if not getattr(args, f"skip_{name}"):
            t = time.perf_counter()
            section(args, result)
            print(f"   ({time.perf_counter() - t:.0f} s)", flush=True)
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    result["date"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    result["machine"] = dict(
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        load_average=os.getloadavg(),
    )
    overhead.write_result(result, args.out, DEFAULT_OUT)
    return result


if __name__ == "__main__":
    main()
