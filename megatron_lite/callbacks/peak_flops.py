"""Peak FLOP/s of one device, the denominator of MFU: a table of known GPUs, else a matmul probe.

MFU (model FLOPs utilization, PaLM / Megatron) divides the model's FLOPs per second by the
device's *dense* peak for the training dtype. GPU peaks are the vendor's dense (non-sparse) tensor
core numbers. A CPU has no such number we can trust across machines, so its "peak" is measured: the
best rate of a square matmul in the training dtype with this process's threads. That makes CPU MFU
"fraction of the achievable matmul rate", which is what one wants to know on a CPU anyway.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

# Dense tensor-core peaks in TFLOP/s per GPU: (bf16/fp16, tf32, plain fp32). NVIDIA data sheets.
# Order matters: the first entry whose every key word is in the device name wins.
_KNOWN_GPU_PEAKS: tuple[tuple[tuple[str, ...], tuple[float, float, float]], ...] = (
    (("H200", "NVL"), (835.5, 417.6, 60.0)),
    (("H200",), (989.4, 494.7, 66.9)),
    (("H100", "PCIE"), (756.5, 378.0, 51.2)),
    (("H100", "NVL"), (835.5, 417.6, 60.0)),
    (("H100",), (989.4, 494.7, 66.9)),  # SXM (reported as "NVIDIA H100 80GB HBM3")
    (("A100",), (312.0, 156.0, 19.5)),
)


def precision_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a Lightning precision string ('bf16-mixed', '16-mixed', '32-true', ...)."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32


def known_gpu_peak_tflops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Dense peak TFLOP/s of a known GPU for ``dtype`` (fp32 uses the TF32 tensor-core peak when
    ``tf32``); None for a GPU or dtype not in the table."""
    name = device_name.upper()
    for keywords, (half, tf32_peak, fp32) in _KNOWN_GPU_PEAKS:
        if all(k in name for k in keywords):
            if dtype in (torch.bfloat16, torch.float16):
                return half
            if dtype == torch.float32:
                return tf32_peak if tf32 else fp32
            return None
    return None


def cuda_tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores (then their peak is the TF32 one)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, size: Optional[int] = None, min_seconds: float = 0.05
) -> float:
    """Best TFLOP/s of one ``size x size`` matmul in ``dtype`` on ``device`` over about ``min_seconds``.

    The default size keeps one product around a millisecond or more on a CPU thread, long enough to
    time, short enough for a quick probe (fp16 is emulated on most CPUs and ~40x slower, so smaller).
    """
    device = torch.device(device)
    if size is None:
        size = 4096 if device.type == "cuda" else (256 if dtype == torch.float16 else 512)
    if not size > 0 or not min_seconds > 0:
        raise ValueError(f"size and min_seconds must be > 0, got {size!r} and {min_seconds!r}")
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up: kernel selection, caches, thread pool start
        torch.mm(a, b)
    sync()
    best = math.inf
    trials = 0
    deadline = time.perf_counter() + min_seconds
    while trials < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
        trials += 1
    return 2.0 * size**3 / best / 1e12
