"""Precision under MegatronStrategy.

Lightning's own plugins are replaced because their loss scaling assumes Lightning runs the
backward: its GradScaler would unscale gradients it never scaled. Here the plugin only decides
the compute dtype (autocast for ``*-mixed``, half-precision parameters for ``*-true``); fp32 master
weights, fp16 loss scaling and skipped steps live in ``megatron_lite.core.optim``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Generator

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


def _dtype_of(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16


class MegatronPrecision(Precision):
    """Compute dtype for MegatronStrategy: ``32-true``, ``bf16-mixed``/``16-mixed`` (autocast, fp32
    parameters) or ``bf16-true``/``16-true`` (half parameters with fp32 masters in the optimizer)."""

    def __init__(self, precision: str = "32-true", device_type: str = "cpu") -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"MegatronStrategy supports precision {', '.join(SUPPORTED_PRECISIONS)}; got {precision!r}. "
                f"fp8 needs Transformer Engine on a GPU (not available here); 64-bit is not supported."
            )
        self.precision = precision
        self.device_type = device_type

    @property
    def fp16(self) -> bool:
        """Whether fp16 is in use (the optimizer then scales the loss and skips overflowing steps)."""
        return self.precision.startswith("16")

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the model parameters (fp32 unless ``*-true`` half precision)."""
        return (
            _dtype_of(self.precision)
            if self.precision.endswith("-true") and self.precision != "32-true"
            else torch.float32
        )

    def check_device(self, device: torch.device) -> None:
        """Refuse half precisions the device cannot run; warn where it runs only slowly."""
        if self.precision == "32-true":
            return
        if device.type == "cuda":
            if self.precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
                raise ValueError(
                    f"precision={self.precision!r}: {torch.cuda.get_device_name(device)} has no bf16 support "
                    f"(it needs compute capability 8.0+); use precision='16-mixed' (fp16 with loss scaling)."
                )
        elif device.type == "cpu" and self.fp16:
            warnings.warn(
                f"precision={self.precision!r} on CPU: fp16 matrix products are emulated and about 40x "
                f"slower than fp32 here; bf16 ('bf16-mixed') is the fast half precision on CPUs.",
                stacklevel=2,
            )

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Weights were drawn in fp32 (layout-independent init) and are cast once here.
        return module.to(self.param_dtype) if self.param_dtype != torch.float32 else module

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=_dtype_of(self.precision))
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield

    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield

    @contextlib.contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield

    @contextlib.contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield

    def state_dict(self) -> dict[str, Any]:
        return {}


def as_megatron_precision(plugin: Any, device_type: str = "cpu") -> MegatronPrecision:
    """Lightning's precision plugin for ``Trainer(precision=...)`` mapped to :class:`MegatronPrecision`."""
    if isinstance(plugin, MegatronPrecision):
        return plugin
    precision = getattr(plugin, "precision", "32-true")
    known = type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision")
    if not known:
        raise ValueError(
            f"MegatronStrategy cannot run with the precision plugin {type(plugin).__name__}; pass "
            f"Trainer(precision=...) with one of {', '.join(SUPPORTED_PRECISIONS)}."
        )
    return MegatronPrecision(precision, device_type=getattr(plugin, "device", device_type))
