"""The measurements of the one-GPU check (benchmarks/gpu_check.py runs them and prints the table): each section
takes the :class:`Check` (device, sizes, measured peak, baseline run) and returns a JSON-able dict whose ``status`` is
``measured`` or ``skipped``/``failed`` with a ``reason``. No ``torch.cuda`` call outside a device check."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Optional

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (REPO_ROOT, BENCH_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import checkpoint  # noqa: E402  (benchmarks/checkpoint.py: bandwidth)
import generate as generate_bench  # noqa: E402  (benchmarks/generate.py: build_weights, rotate)
import overhead  # noqa: E402  (benchmarks/overhead.py: run_plain, run_framework, sync)
import throughput  # noqa: E402  (benchmarks/throughput.py: summarize, i.e. tokens/s, TFLOP/s and MFU)

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks.metrics import peak_memory_gib  # noqa: E402
from megatron_lite.callbacks.peak_flops import known_gpu_peak_tflops, measure_matmul_tflops  # noqa: E402
from megatron_lite.core.estimator.flops import forward_flops_breakdown  # noqa: E402
from megatron_lite.core.inference import generate  # noqa: E402
from megatron_lite.core.models.attention import CoreAttention  # noqa: E402
from megatron_lite.core.parallel.random import model_parallel_rng_tracker  # noqa: E402

# Llama 3.2 1B's layers (16 x hidden 2048, 32 heads in 8 groups, SwiGLU 8192) with a 32k vocabulary, untied: 1.10 B.
GPU_MODEL = dict(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=8192,
    vocab_size=32000,
    seq_length=2048,
)
SMOKE_MODEL = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=256
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each measurement is: the GPU run's, or the CPU smoke run's tiny ones."""

    model: dict
    """GPTConfig fields of the trained model (seq_length included)."""
    micro_batch_size: int
    """Samples per microbatch."""
    global_batch_size: int
    """Samples per optimizer step (micro_batch_size x microbatches)."""
    steps: int
    """Optimizer steps per training run (warm-up included)."""
    warmup: int
    """First steps of every run left out of the statistics."""
    repeats: int
    """Runs of the plain loop and of the framework, alternating (ABAB)."""
    attention_iterations: int
    """Timed forward + backward passes per SDPA backend (and per fp8 / bf16 layer)."""
    prompt_length: int
    """Prompt tokens of the generation rows."""
    new_tokens: int
    """Tokens generated per row."""
    batches: tuple[int, ...]
    """Prompts per generation row."""
    generation_repeats: int
    """Timed rounds of the generation rows (after one warm-up round)."""
    checkpoint_layers: int
    """Layers of the checkpointed model (the training width)."""
    checkpoint_repeats: int
    """Save + load rounds of the checkpoint bandwidth."""
    matmul_size: Optional[int]
    """Side of the peak-probe matmul (None: measure_matmul_tflops' default for the device)."""


GPU_SIZES = Sizes(GPU_MODEL, 4, 8, 10, 3, 2, 10, 128, 128, (1, 16), 2, 4, 1, 8192)
SMOKE_SIZES = Sizes(dict(SMOKE_MODEL, seq_length=32), 2, 4, 3, 1, 1, 1, 4, 4, (1, 2), 1, 2, 1, None)
PRECISION = "bf16-mixed"
OPTIMIZER = ml.OptimizerConfig(lr=3e-4, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)


class Check:
    """What every section needs: the device, the sizes, the measured peak and the baseline run of the framework."""

    def __init__(self, device: torch.device, sizes: Sizes):
        self.device, self.sizes = device, sizes
        self.config = ml.GPTConfig(**sizes.model)
        self.dtype = torch.bfloat16
        self.peak_tflops: Optional[float] = None
        self.baseline: Optional[dict] = None  # the framework's summary from the training section
        self.run_args = argparse.Namespace(
            steps=sizes.steps,
            warmup=sizes.warmup,
            micro_batch_size=sizes.micro_batch_size,
            global_batch_size=sizes.global_batch_size,
            seq_length=self.config.seq_length,
        )

    @property
    def accelerator(self) -> str:
        return "gpu" if self.device.type == "cuda" else "cpu"

    def timed_run(self, fn: Callable[[], dict]) -> dict:
        """``fn()`` (one training run) with the peak memory it reached (CUDA only: a process's RSS peak on a CPU
        never goes down, so it would not be this run's)."""
        free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        result = fn()
        result["peak_memory_gib"] = peak_memory_gib(self.device) if self.device.type == "cuda" else None
        return result

    def framework(self, config: Optional[ml.GPTConfig] = None, optimizer: ml.OptimizerConfig = OPTIMIZER) -> dict:
        """One Trainer + MegatronStrategy + GPTModule run in this process."""
        config = config or self.config
        return self.timed_run(
            lambda: overhead.run_framework(
                config, optimizer, self.run_args, accelerator=self.accelerator, precision=PRECISION
            )
        )

    def summary(self, reps: list[dict], config: Optional[ml.GPTConfig] = None) -> dict:
        """Median step, tokens/s, TFLOP/s and MFU against the measured peak (throughput.summarize)."""
        s = throughput.summarize(reps, self.run_args, config or self.config, 1, 1, self.peak_tflops or float("nan"))
        peaks = [r["peak_memory_gib"] for r in reps if r.get("peak_memory_gib") is not None]
        s["peak_memory_gib"] = max(peaks) if peaks else None
        return s

    def time_passes(self, fn: Callable[[], object], iterations: int) -> float:
        """Median seconds of ``fn()`` over ``iterations`` timed calls after two warm-up calls, synchronized."""
        for _ in range(2):
            fn()
        overhead.sync(self.device)
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            overhead.sync(self.device)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


def free_memory(device: torch.device) -> None:
    """Give the last run's GPU memory back before the next one (a 1B model and its AdamW state are ~18 GB). Nothing
    on a CPU, where a full garbage collection of this process would cost the smoke run seconds."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


# --- 1. tests/gpu -----------------------------------------------------------------------------------------------
def run_gpu_tests(timeout_s: float) -> dict:
    """``pytest tests/gpu`` in a child process (its own session: killed whole at the timeout); the outcome of
    every test from its JUnit XML."""
    with tempfile.TemporaryDirectory(prefix="ml_gpu_check_") as tmp:
        report = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}"]
        proc = subprocess.Popen([*command, "tests/gpu"], cwd=REPO_ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "failed", "reason": f"tests/gpu ran past --tests-timeout ({timeout_s:.0f} s): killed"}
        if not report.exists():
            return {"status": "failed", "reason": f"pytest exited with code {code} and wrote no report"}
        outcomes: dict[str, list] = {"passed": [], "failed": [], "skipped": []}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                outcomes["failed"].append(name)
            elif (skip := case.find("skipped")) is not None:
                outcomes["skipped"].append(f"{name}: {skip.get('message', '')}")
            else:
                outcomes["passed"].append(name)
    return {"status": "measured" if code in (0, 5) else "failed", "exit_code": code, **outcomes}


# --- 2. matmul peak ---------------------------------------------------------------------------------------------
def matmul_peak(check: Check) -> dict:
    seconds = 1.0 if check.device.type == "cuda" else 0.05
    check.peak_tflops = measure_matmul_tflops(check.device, check.dtype, check.sizes.matmul_size, min_seconds=seconds)
    sheet = known_gpu_peak_tflops(torch.cuda.get_device_name(check.device), check.dtype) if _cuda(check) else None
    return {
        "status": "measured",
        "tflops": check.peak_tflops,
        "data_sheet_tflops": sheet,
        "fraction_of_data_sheet": check.peak_tflops / sheet if sheet else None,
    }


def _cuda(check: Check) -> bool:
    return check.device.type == "cuda"


# --- 3. training step: ours against a plain loop ----------------------------------------------------------------
def training(check: Check) -> dict:
    reps: dict[str, list[dict]] = {"plain": [], "megatron": []}
    runners = {
        "plain": lambda: check.timed_run(
            lambda: overhead.run_plain(check.config, OPTIMIZER, check.run_args, str(check.device), PRECISION)
        ),
        "megatron": check.framework,
    }
    for rep in range(check.sizes.repeats):
        for name in ("plain", "megatron") if rep % 2 == 0 else ("megatron", "plain"):
            reps[name].append(runners[name]())
    plain, ours = check.summary(reps["plain"]), check.summary(reps["megatron"])
    check.baseline = ours
    return {
        "status": "measured",
        "num_parameters": check.config.num_parameters(),
        "tokens_per_step": check.sizes.global_batch_size * check.config.seq_length,
        "plain": plain,
        "megatron": ours,
        "overhead": ours["median_ms"] / plain["median_ms"] - 1,
        "max_loss_difference": max(
            abs(a - b) for a, b in zip(reps["plain"][0]["losses"], reps["megatron"][0]["losses"])
        ),
    }


# --- 4. attention: the SDPA backends ----------------------------------------------------------------------------
def attention(check: Check) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c, b = check.config, check.sizes.micro_batch_size
    assert c.kv_channels is not None and c.num_query_groups is not None  # resolved by GPTConfig
    core = CoreAttention(0.0, c.num_attention_heads // c.num_query_groups)
    rng = model_parallel_rng_tracker(seed=0, tp_rank=0)
    generator = torch.Generator(device=check.device).manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        shape = (c.seq_length, b, heads, c.kv_channels)
        return torch.randn(shape, device=check.device, dtype=check.dtype, generator=generator).requires_grad_()

    q, k, v = tensor(c.num_attention_heads), tensor(c.num_query_groups), tensor(c.num_query_groups)
    grad = torch.randn(c.seq_length, b, c.num_attention_heads * c.kv_channels, device=check.device, dtype=check.dtype)

    def pass_() -> None:
        core(q, k, v, rng).backward(grad)

    # one layer's causal attention, forward + backward (3 x forward: the estimator's convention)
    flops = 3 * forward_flops_breakdown(c).attention / c.num_layers * b * c.seq_length
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    rows: dict[str, dict] = {}
    for name, backend in backends.items():
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                seconds = check.time_passes(pass_, check.sizes.attention_iterations)
        except RuntimeError as error:  # this backend cannot run these inputs on this device
            rows[name] = {"available": False, "reason": str(error).strip().splitlines()[0][:200]}
            continue
        rows[name] = {"available": True, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
    fastest = min((r["ms"] for r in rows.values() if r["available"]), default=None)
    return {
        "status": "measured",
        "shape": {"batch": b, "seq": c.seq_length, "heads": c.num_attention_heads, "groups": c.num_query_groups},
        "flops_per_pass": flops,
        "backends": rows,
        "default_vs_fastest": rows["default"]["ms"] / fastest if rows["default"]["available"] and fastest else None,
    }


# --- 5. fp8 through Transformer Engine --------------------------------------------------------------------------
def fp8(check: Check) -> dict:
    if not _cuda(check):
        return skipped("needs CUDA: Transformer Engine's fp8 GEMMs run on NVIDIA GPUs only")
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except ImportError as error:
        return skipped(f"Transformer Engine does not import ({error}): pip install 'megatron-lite[te]'")
    capability = torch.cuda.get_device_capability(check.device)
    if capability < (8, 9):
        return skipped(f"fp8 needs compute capability 8.9+ (Ada, Hopper); this GPU has {capability}")
    c, b = check.config, check.sizes.micro_batch_size
    layer = te.TransformerLayer(
        c.hidden_size,
        c.ffn_hidden_size,
        c.num_attention_heads,
        num_gqa_groups=c.num_query_groups,
        normalization="RMSNorm",
        activation="swiglu",
        bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        params_dtype=check.dtype,
        device="cuda",
    )
    x = torch.randn(c.seq_length, b, c.hidden_size, device=check.device, dtype=check.dtype, requires_grad=True)
    recipe = DelayedScaling(fp8_format=Format.HYBRID)

    def pass_(enabled: bool) -> Callable[[], None]:
        def run() -> None:
            with te.fp8_autocast(enabled=enabled, fp8_recipe=recipe):
                out = layer(x)
            out.backward(torch.ones_like(out))

        return run

    parts = forward_flops_breakdown(c)
    per_layer_token = (parts.total - parts.logits) / c.num_layers
    flops = 3 * per_layer_token * b * c.seq_length
    bf16 = check.time_passes(pass_(False), check.sizes.attention_iterations)
    fp8_s = check.time_passes(pass_(True), check.sizes.attention_iterations)
    import transformer_engine

    return {
        "status": "measured",
        "transformer_engine": getattr(transformer_engine, "__version__", "unknown"),
        "bf16_ms": bf16 * 1e3,
        "fp8_ms": fp8_s * 1e3,
        "bf16_tflops": flops / bf16 / 1e12,
        "fp8_tflops": flops / fp8_s / 1e12,
        "fp8_speedup": bf16 / fp8_s,
        "note": "one TE TransformerLayer of the model's shape; MegatronStrategy has no fp8 precision yet",
    }


# --- 6. and 7. recompute and the distributed optimizer ----------------------------------------------------------
def _against_baseline(check: Check, name: str, reps: list[dict], config: Optional[ml.GPTConfig] = None) -> dict:
    if check.baseline is None:
        return skipped("the training section (its baseline) did not run")
    s = check.summary(reps, config)
    base = check.baseline
    return {
        name: s,
        "step_vs_none": s["median_ms"] / base["median_ms"],
        "peak_memory_vs_none": (
            s["peak_memory_gib"] / base["peak_memory_gib"] if s["peak_memory_gib"] and base["peak_memory_gib"] else None
        ),
        "max_loss_difference_vs_none": max(abs(a - b) for a, b in zip(s["losses"][0], base["losses"][0])),
    }


def recompute(check: Check) -> dict:
    variants = {
        "selective": dict(recompute_granularity="selective"),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }
    result: dict = {"status": "measured"}
    for name, fields in variants.items():
        config = dataclasses.replace(check.config, **fields)
        result[name] = _against_baseline(check, name, [check.framework(config)], config)
        if result[name].get("status") == "skipped":
            return result[name]
    return result


def distributed_optimizer(check: Check) -> dict:
    run = check.framework(optimizer=dataclasses.replace(OPTIMIZER, use_distributed_optimizer=True))
    return {"status": "measured", **_against_baseline(check, "distributed", [run])}


# --- 8. generation against transformers -------------------------------------------------------------------------
def generation(check: Check) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        return skipped(f"transformers does not import ({error}): nothing to compare with")
    s = check.sizes
    shape = {k: v for k, v in check.config.__dict__.items() if k in SMOKE_MODEL}
    context = s.prompt_length + s.new_tokens
    vocab = check.config.vocab_size
    with tempfile.TemporaryDirectory(prefix="ml_gpu_check_hf_", dir=_scratch()) as tmp:
        module, hf = generate_bench.build_weights(Path(tmp), context, True, shape, str(check.device), check.dtype)
    model, n = module.model, s.new_tokens
    rows: dict[str, Callable[[], object]] = {}
    prompts: dict[int, list[list[int]]] = {}
    for batch in s.batches:
        prompts[batch] = [[(7 * i + 3 + 11 * r) % vocab for i in range(s.prompt_length)] for r in range(batch)]
        ids = torch.tensor(prompts[batch], device=check.device)
        rows[f"ours, batch {batch}"] = lambda p=prompts[batch]: generate(model, p, n)
        rows[f"transformers, batch {batch}"] = lambda ids=ids: _hf_generate(hf, ids, n, check.device)
    times, _ = generate_bench.rotate(rows, s.generation_repeats)
    rates = {name: n * int(name.rsplit(" ", 1)[1]) / sorted(t)[len(t) // 2] for name, t in times.items()}
    ours = generate(model, prompts[s.batches[0]][:1], n).tokens[0]
    theirs = _hf_generate(hf, torch.tensor(prompts[s.batches[0]][:1], device=check.device), n, check.device)
    theirs = theirs[0, s.prompt_length :].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return {
        "status": "measured",
        "tokens_per_s": rates,
        "ratios": {f"batch {b}": rates[f"ours, batch {b}"] / rates[f"transformers, batch {b}"] for b in s.batches},
        "greedy_tokens_equal_for": agree,
        "new_tokens": n,
    }


def _hf_generate(hf, ids: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    out = generate_bench.hf_greedy(hf, ids, n)
    overhead.sync(device)  # its tokens stay on the GPU: the timing must wait for them
    return out


def _scratch() -> Path:
    """Where big files go: ``build/`` in the repository (a disk; /tmp may be memory, which is not what a
    checkpoint's GB/s is about)."""
    path = REPO_ROOT / "build"
    path.mkdir(exist_ok=True)
    return path


# --- 9. checkpoint save / load ----------------------------------------------------------------------------------
def checkpoint_bandwidth(check: Check) -> dict:
    c = check.config
    args = argparse.Namespace(
        hidden_size=c.hidden_size,
        num_layers=check.sizes.checkpoint_layers,
        num_attention_heads=c.num_attention_heads,
        vocab_size=c.vocab_size,
        seq_length=c.seq_length,
        repeats=check.sizes.checkpoint_repeats,
    )
    with tempfile.TemporaryDirectory(prefix="ml_gpu_check_ckpt_", dir=_scratch()) as tmp:
        result = checkpoint.bandwidth(args, Path(tmp), str(check.device))
    return {"status": "measured", "directory": str(_scratch()), "layers": args.num_layers, **result}


SECTIONS: dict[str, Callable[[Check], dict]] = {
    "matmul_peak": matmul_peak,
    "training": training,
    "attention": attention,
    "fp8": fp8,
    "recompute": recompute,
    "distributed_optimizer": distributed_optimizer,
    "generation": generation,
    "checkpoint": checkpoint_bandwidth,
}
