"""Test-wide settings: one torch thread per process (ranks are forked from the test process), the package
compiled once for the processes the tests start, and under xdist whole modules per worker, the longest kinds
first (see docs/test-budget.md)."""

import compileall
import importlib
import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Compile the package's bytecode once (in the controlling process, not in each xdist worker). With
    PYTHONDONTWRITEBYTECODE set nothing is cached, and each of the ~85 interpreters the tests start (CLI runs,
    torchrun and script ranks) would compile the package again: ~0.35 s of CPU apiece."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(Path(__file__).resolve().parents[1] / "megatron_lite", quiet=1)


@pytest.fixture(scope="session")
def megatron_core():
    """Imports a module of megatron-core, the reference some tests compare against (a dev dependency): call it with
    the module's name. Any failure to import it skips the test, with the reason; its warnings about a missing
    Transformer Engine or Apex are silenced."""

    def load(name: str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return importlib.import_module(name)
        except Exception as error:
            pytest.skip(f"megatron-core is not importable here ({type(error).__name__}: {error})")

    return load


def _module_rank(items) -> int:
    """0: a module with a slow test; 1: the other end-to-end tests (processes, Trainers); 2: the parity tests
    on forked ranks; 3: the rest (unit tests, mostly well under a second)."""
    if any(item.get_closest_marker("slow") for item in items):
        return 0
    path = items[0].nodeid
    return 1 if path.startswith("tests/integration/") else 2 if path.startswith("tests/distributed/") else 3


def pytest_collection_modifyitems(config, items) -> None:
    """Whole modules, the longest kinds first, each module's tests in their order (its module fixtures are
    built once). Under xdist the workers take the modules in this order (see pytest_xdist_make_scheduler), so
    the modules of minutes start early and the last ones to start are short: no worker is left with a long
    test while the other has nothing to do."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for module in sorted(modules.values(), key=_module_rank) for item in module]


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (`make test`) keeps each test module on one worker, taken in collection order.

    A module's tests share its module fixtures (a trained checkpoint, the bare-install venv, the resharding
    sources): split over two workers, each built them again. Its xdist_group marks said so, but pytest 9.2's
    structured node ids made xdist 3.8 drop them silently (pytest-dev/pytest-xdist#1386: every test was
    scheduled on its own). Whole modules are what the marks asked for, and more; a group that spans modules
    (an "@group" suffix, once xdist keeps it again) still goes to one worker. xdist's reordering by test
    count would put the modules of many quick unit tests first: the order of pytest_collection_modifyitems
    is kept instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return super()._split_scope(nodeid)
            return nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)
