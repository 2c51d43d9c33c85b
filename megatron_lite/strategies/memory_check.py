"""The run's memory estimate, and refusing a run that cannot fit before any weight is built.

:func:`~megatron_lite.core.estimator.run.estimate_objective` is the per-rank estimate of a module and its data
as the run description lays them out (every pipeline stage's), with what a sample costs the module's objective (a
DPO pair is two rows and a reference model). :func:`check_memory_fits` compares it with what the machine has,
where the strategy checks a run (before it starts any process, and in every rank before its weights are built):

- on CPU, every rank of a host allocates from the same memory: the ranks on this host (devices per node)
  together against ``MemAvailable`` of ``/proc/meminfo`` (and a container's cgroup limit, when lower);
- on a GPU, each rank against the free memory of its own device (``torch.cuda.mem_get_info``), in the rank.

``fit`` needs every byte of the estimate (weights, gradients, optimizer state, activations); validate, test
and predict the weights (and a reference model's). Estimates can be conservative: ``MegatronStrategy(
check_memory=False)`` runs anyway.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from megatron_lite.core.estimator.memory import MemoryEstimate
from megatron_lite.core.units import format_bytes

_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


class InsufficientMemoryError(ValueError):
    """The run's estimated memory exceeds what the machine has (before anything was allocated)."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        """Estimated bytes (of the ranks on this host on CPU, of one rank on a GPU)."""
        self.available = available
        """Bytes available to them."""


def available_host_memory() -> Optional[tuple[int, str]]:
    """(bytes this host can still give, where that comes from): ``MemAvailable`` of ``/proc/meminfo`` (else
    the free physical pages), lowered to a container's cgroup memory limit minus its usage; None if unknown."""
    found: Optional[tuple[int, str]] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages")
        except (ValueError, OSError, AttributeError):
            return None
    for limit, usage in (
        ("memory.max", "memory.current"),  # cgroup v2, then v1
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap, used = (int(Path("/sys/fs/cgroup", name).read_text()) for name in (limit, usage))
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
        if cap < _NO_LIMIT and cap - used < found[0]:
            found = (max(cap - used, 0), f"the cgroup limit in /sys/fs/cgroup/{limit}")
        break
    return found


def _needed(stage: MemoryEstimate, fitting: bool) -> int:
    return stage.total_bytes if fitting else stage.weights_bytes + stage.frozen_bytes


def _parts(stage: MemoryEstimate, fitting: bool) -> str:
    parts = [("weights", stage.weights_bytes), ("reference model", stage.frozen_bytes)]
    if fitting:
        parts[1:1] = [
            ("gradients", stage.grads_bytes),
            ("optimizer state", stage.optimizer_bytes),
            ("activations", stage.activation_bytes),
        ]
    return ", ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)


_FIXES = (
    "split the model over more devices (tensor_model_parallel_size, pipeline_model_parallel_size), shard what "
    "the data-parallel replicas repeat (use_torch_fsdp2=True, or OptimizerConfig(use_distributed_optimizer="
    "True)), turn on activation recompute or lower micro_batch_size, or train a smaller model"
)
_OVERRIDE = (
    "If the estimate is too conservative for this run, MegatronStrategy(check_memory=False) "
    "(--trainer.strategy.init_args.check_memory false) skips this check."
)


def check_memory_fits(
    estimate: MemoryEstimate,
    *,
    fitting: bool,
    device_type: str,
    ranks_on_host: int,
    world_size: int,
    device: Optional[torch.device] = None,
) -> None:
    """Raise :class:`InsufficientMemoryError` when ``estimate`` (``fitting``: the whole step; else the weights)
    exceeds this host's available memory (CPU: the ``ranks_on_host`` ranks together) or, given the rank's CUDA
    ``device``, that device's free memory. Nothing is allocated."""
    stages = estimate.stages or [estimate]
    most = max(stages, key=lambda s: _needed(s, fitting))
    per_rank = _needed(most, fitting)
    what = "train" if fitting else "hold the weights"
    stage = f" (pipeline stage {most.pipeline_stage}, the most loaded)" if len(stages) > 1 else ""
    if device_type == "cpu":
        host = available_host_memory()
        if host is not None:
            if ranks_on_host >= world_size:  # every rank here: each stage's share of them, exactly
                needed = sum(_needed(s, fitting) for s in stages) * (world_size // len(stages))
            else:
                needed = ranks_on_host * per_rank
            available, source = host
            if needed > available:
                raise InsufficientMemoryError(
                    f"this run needs about {format_bytes(needed)} of host memory to {what}: {ranks_on_host} rank(s) "
                    f"on this host, each up to {format_bytes(per_rank)}{stage} ({_parts(most, fitting)}), and on "
                    f"CPU they all share this host's memory -- but only {format_bytes(available)} is available "
                    f"({source}); it would be killed or swap before its first step. To fit: {_FIXES}; on CPU "
                    f"fewer processes per host or more hosts help too. {_OVERRIDE}",
                    needed,
                    available,
                )
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if per_rank > free:
            raise InsufficientMemoryError(
                f"this run needs about {format_bytes(per_rank)} of memory on {device} to {what}{stage} "
                f"({_parts(most, fitting)}), but only {format_bytes(free)} of it is free. To fit: {_FIXES}. "
                f"{_OVERRIDE}",
                per_rank,
                free,
            )
