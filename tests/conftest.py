"""Test-wide settings: one torch thread per process (ranks are forked from the test process), the package
compiled once for the processes the tests start, and the longest test files first (see docs/test-budget.md)."""
import compileall
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Compile the package's bytecode once (in the controlling process, not in each xdist worker). With
    PYTHONDONTWRITEBYTECODE set nothing is cached, and each of the ~70 interpreters the tests start (CLI runs,
    torchrun and script ranks) would compile the package again: ~0.35 s of CPU apiece."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(Path(__file__).resolve().parents[1] / "megatron_lite", quiet=1)


def _module_rank(items) -> int:
    """0: a module with a slow test; 1: the other end-to-end tests (processes, Trainers); 2: the parity tests
    on forked ranks; 3: the rest (unit tests, mostly well under a second)."""
    if any(item.get_closest_marker("slow") for item in items):
        return 0
    path = items[0].nodeid
    return 1 if path.startswith("tests/integration/") else 2 if path.startswith("tests/distributed/") else 3


def pytest_collection_modifyitems(config, items) -> None:
    """Whole modules, the longest kinds first, each module's tests in their order (its module fixtures are
    built once). Under xdist (`make test`: --dist loadgroup) the workers take tests in this order, so the
    tests of minutes start early and the last ones to start are the short ones: no worker is left with a
    long test while the other has nothing to do."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for module in sorted(modules.values(), key=_module_rank) for item in module]
