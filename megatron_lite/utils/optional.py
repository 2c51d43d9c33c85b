"""Optional dependencies: imported where they are used, and a missing one is one line naming the extra.

A bare ``pip install megatron-lite`` must import, train on mock data and print every ``--help``; the
tokenizer backends, corpus readers, progress bars and plots pull in packages from the extras only when
they run. ``require("sentencepiece", "SentencePieceTokenizer")`` returns the module or raises::

    MissingDependencyError: SentencePieceTokenizer needs the 'sentencepiece' package: pip install "megatron-lite[data]"

``OPTIONAL`` is the one table of which extra provides which module (a test checks it against pyproject.toml).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple


class Provider(NamedTuple):
    """Where an optional module comes from."""

    distribution: str
    """The pip package that provides the module."""
    extra: str
    """The megatron-lite extra that installs it."""


OPTIONAL: dict[str, Provider] = {
    "sentencepiece": Provider("sentencepiece", "data"),
    "tokenizers": Provider("tokenizers", "data"),
    "tiktoken": Provider("tiktoken", "data"),
    "pyarrow": Provider("pyarrow", "data"),
    "datasets": Provider("datasets", "data"),
    "tqdm": Provider("tqdm", "data"),
    "tensorboard": Provider("tensorboard", "logging"),
    "wandb": Provider("wandb", "logging"),
    "matplotlib": Provider("matplotlib", "logging"),
    "pynvml": Provider("nvidia-ml-py", "logging"),
    "modelopt": Provider("nvidia-modelopt", "modelopt"),
    "transformer_engine": Provider("transformer-engine", "te"),
}
"""Top-level module name -> the distribution and the megatron-lite extra that provide it."""


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that fixes it."""


def missing_dependency(distribution: str, extra: str, purpose: str) -> MissingDependencyError:
    """The one-line error for ``purpose`` lacking ``distribution`` (installed by megatron-lite's ``extra``)."""
    return MissingDependencyError(f'{purpose} needs the {distribution!r} package: pip install "megatron-lite[{extra}]"')


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (a key of ``OPTIONAL``, or a submodule of one) for ``purpose`` (what the user ran).

    Only the package itself being absent becomes ``MissingDependencyError``; an installed package that
    fails to import for another reason keeps its own error, which says more than "install it".
    """
    top = module.partition(".")[0]
    provider = OPTIONAL[top]  # KeyError: a new optional dependency must be added to the table
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] != top:
            raise
        raise missing_dependency(provider.distribution, provider.extra, purpose) from None
