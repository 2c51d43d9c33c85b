"""The old import paths of modules that moved, kept for now (deprecated): ``from megatron_lite.convert import
to_hf`` and ``megatron_lite.plot`` still work, give the module at its new place (the same object) and warn once
with a ``DeprecationWarning`` naming that place. They go away in a later release.

One finder on ``sys.meta_path``, added by ``import megatron_lite``: it answers only for the names in :data:`MOVED`
(no file has them any more), so nothing else is affected. It goes first: an editable install's finder would
otherwise answer for them from another checkout's files.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

MOVED = {
    # the command-line verbs, into megatron_lite/cli/
    "megatron_lite.checkpoint_tool": "megatron_lite.cli.checkpoint",
    "megatron_lite.cli_errors": "megatron_lite.cli.parse_errors",
    "megatron_lite.convert": "megatron_lite.cli.convert",
    "megatron_lite.estimate": "megatron_lite.cli.estimate",
    "megatron_lite.generate": "megatron_lite.cli.generate",
    "megatron_lite.pipeline_timeline": "megatron_lite.cli.pipeline_timeline",
    "megatron_lite.plot": "megatron_lite.cli.plot",
    "megatron_lite.prune": "megatron_lite.cli.prune",
    "megatron_lite.quantize": "megatron_lite.cli.quantize",
    # moved down (or up) a layer so that no two packages import each other (the acyclic contract, pyproject.toml)
    "megatron_lite.core.parallel.pipeline.stages": "megatron_lite.core.parallel.pipeline_stages",
    "megatron_lite.core.parallel.validation": "megatron_lite.core.models.run_checks",
}
"""Old module name -> where the module is now."""


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new place."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self.new_name}; import it from there (the old name will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system returns what sys.modules holds under the name once the loader is done, so the old
        # name is the new module itself (one module object: its state and its patches are shared).
        sys.modules[module.__name__] = importlib.import_module(self.new_name)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED`, and nothing else."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        new_name = MOVED.get(fullname)
        return None if new_name is None else importlib.util.spec_from_loader(fullname, _MovedModuleLoader(new_name))


def install_moved_module_aliases() -> None:
    """Put the finder of the old names first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
