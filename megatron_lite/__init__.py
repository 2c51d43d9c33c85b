"""megatron-lite: Megatron-LM's training stack as a Lightning-native library.

``import megatron_lite`` registers the ``"megatron"`` strategy, so ``Trainer(strategy="megatron")`` works.
The public names (``ml.GPTModule``, ``ml.MegatronStrategy``, ...) and the subpackages ``ml.data``,
``ml.callbacks``, ``ml.post_training`` and ``ml.tokenizers`` are imported on first use
(``ml.callbacks.MegatronMetrics(...)`` after only ``import megatron_lite as ml``).

The registration needs Lightning's strategy registry, so it imports Lightning (seconds). The ``megatron-lite``
command's own process skips it: ``--help``, ``checkpoint inspect``, ``convert --to hf``, ``preprocess``, ... never
touch Lightning there, and the verbs that train register the strategy themselves
(:func:`megatron_lite.cli.lightning_cli.run_lightning_cli`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from megatron_lite._moved_modules import MOVED, install_moved_module_aliases

if TYPE_CHECKING:  # what the lazy attributes below resolve to, for type checkers and IDEs
    from megatron_lite import callbacks, data, post_training, tokenizers  # noqa: F401  (lazy subpackages)
    from megatron_lite.core.models import GPTConfig, GPTModel
    from megatron_lite.core.optim import OptimizerConfig
    from megatron_lite.core.parallel import ParallelConfig, ParallelLayout
    from megatron_lite.module import GPTModule
    from megatron_lite.strategies import MegatronStrategy

__version__ = "0.1.0"
__all__ = [
    "GPTConfig",
    "GPTModel",
    "GPTModule",
    "MegatronStrategy",
    "OptimizerConfig",
    "ParallelConfig",
    "ParallelLayout",
    "__version__",
]

_LAZY_NAMES = {
    "GPTConfig": "megatron_lite.core.models",
    "GPTModel": "megatron_lite.core.models",
    "GPTModule": "megatron_lite.module",
    "MegatronStrategy": "megatron_lite.strategies",
    "OptimizerConfig": "megatron_lite.core.optim",
    "ParallelConfig": "megatron_lite.core.parallel",
    "ParallelLayout": "megatron_lite.core.parallel",
}
"""Public name -> the module that defines it."""
_LAZY_SUBPACKAGES = ("callbacks", "data", "post_training", "tokenizers")
COMMAND = "megatron-lite"
"""The console script (``pyproject.toml``); ``python -m megatron_lite`` runs the same."""


def _is_the_command_process() -> bool:
    """Whether this process was started as the ``megatron-lite`` command: the console script (``sys.argv[0]`` is
    its path), or ``python -m megatron_lite`` (while the package is imported for it, ``sys.argv[0]`` is ``-m`` and
    the interpreter's own arguments name the module)."""
    argv = getattr(sys, "argv", None) or [""]
    if os.path.basename(argv[0]).removesuffix(".exe") == COMMAND:
        return True
    if argv[0] != "-m":
        return False
    options = list(getattr(sys, "orig_argv", []))
    at = next((i for i, option in enumerate(options) if option.startswith("-m")), None)  # -m NAME, or -mNAME
    if at is None:
        return False
    module = options[at][2:] or (options[at + 1] if at + 1 < len(options) else "")
    return module in (__name__, f"{__name__}.__main__")


if not _is_the_command_process():
    from megatron_lite.strategies import register_megatron_strategy

    register_megatron_strategy()
install_moved_module_aliases()


def __getattr__(name: str) -> Any:
    """The public names and subpackages, imported on first use (and then bound here: no second look-up)."""
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBPACKAGES:
        # import_module also binds the subpackage on this module, so later look-ups never come back here
        return importlib.import_module(f"{__name__}.{name}")
    if f"{__name__}.{name}" in MOVED:  # a module's old name (deprecated): the module at its new place
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The eager names plus the lazy ones, for tab completion."""
    return sorted({*globals(), *_LAZY_NAMES, *_LAZY_SUBPACKAGES})
