"""megatron-lite: Megatron-LM's training stack as a Lightning-native library.

``import megatron_lite`` registers the ``"megatron"`` strategy, so ``Trainer(strategy="megatron")`` works.
``ml.data``, ``ml.callbacks`` and ``ml.tokenizers`` are imported on first use (``ml.callbacks.MegatronMetrics(...)``
after only ``import megatron_lite as ml``), so that the import stays as fast as the strategy needs.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel import ParallelConfig, ParallelLayout
from megatron_lite.module import GPTModule
from megatron_lite.strategies import MegatronStrategy, register_megatron_strategy

if TYPE_CHECKING:  # what the lazy attributes below resolve to, for type checkers and IDEs
    from megatron_lite import callbacks, data, post_training, tokenizers

register_megatron_strategy()

__version__ = "0.1.0"
__all__ = ["GPTConfig", "GPTModel", "GPTModule", "MegatronStrategy", "OptimizerConfig", "ParallelConfig",
           "ParallelLayout", "__version__"]

_LAZY_SUBPACKAGES = ("callbacks", "data", "post_training", "tokenizers")


def __getattr__(name: str) -> ModuleType:
    """``ml.data`` / ``ml.callbacks`` / ``ml.tokenizers`` without importing them (and their packages) up front."""
    if name in _LAZY_SUBPACKAGES:
        # import_module also binds the subpackage on this module, so later look-ups never come back here
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The eager names plus the lazy subpackages, for tab completion."""
    return sorted({*globals(), *_LAZY_SUBPACKAGES})
