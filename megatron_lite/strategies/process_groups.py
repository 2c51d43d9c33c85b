"""The run's process groups: the default group joined and the layout's groups built over it in each rank's set-up,
and both released when the run (or the process) ends."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, Optional

import torch

from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.strategies._lightning_private import _distributed_is_initialized, _init_dist_connection


def join_process_groups(
    cluster_environment: Any,
    backend: str,
    device: torch.device,
    timeout: Optional[timedelta],
    parallel: ParallelConfig,
    release_at_exit: bool,
) -> tuple[ParallelLayout, bool]:
    """Join the default process group (unless this process is in one already) and build the layout's groups, each
    with ``timeout``; return the layout and whether the default group was created here. ``release_at_exit``: for a
    process that goes on after the run (a script, torchrun, the launching process itself), which may still use the
    trained model's groups (generation on every TP rank after fit, as in the demo): they are released when the
    process exits, before gloo's own teardown can abort it."""
    options: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        options["device_id"] = device
    created = not _distributed_is_initialized()
    _init_dist_connection(cluster_environment, backend, **options)
    layout = ParallelLayout.build(parallel, device_type=device.type, timeout=timeout)
    if release_at_exit:
        atexit.register(release_process_groups, layout, created)
    return layout, created


def release_process_groups(layout: Optional[ParallelLayout], default_group: bool) -> None:
    """Destroy the layout's groups and, if ``default_group``, the default one. Local (no collective), idempotent."""
    if layout is not None:
        layout.destroy()
    if default_group and _distributed_is_initialized():
        torch.distributed.destroy_process_group()
