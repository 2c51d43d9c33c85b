"""The only place that touches private Lightning APIs (pinned: lightning 2.4 - 2.6).

Lightning's launchers are private classes; a custom strategy has no public way to create processes.
We wrap them to run our configuration checks in the launching process, before any child exists,
so a bad configuration fails once with a clear message instead of N times from N ranks.
"""
from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class ValidatingLauncher(_Launcher):
    """Delegates to Lightning's launcher after ``validate(args)`` passed."""

    def __init__(self, inner: _Launcher, validate: Callable[[tuple, dict, Any], None]):
        self.inner, self.validate = inner, validate

    @property
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self.validate(args, kwargs, trainer)
        return self.inner.launch(function, *args, trainer=trainer, **kwargs)

    def kill(self, signum) -> None:
        self.inner.kill(signum)


def make_launcher(strategy, start_method: str, validate: Callable[[tuple, dict, Any], None]) -> _Launcher:
    """Lightning's subprocess-script launcher ('popen') or multiprocessing launcher, validated."""
    if start_method == "popen":
        inner = _SubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    else:
        inner = _MultiProcessingLauncher(strategy, start_method=start_method)
    return ValidatingLauncher(inner, validate)
