"""Run a function on N forked ranks joined by a gloo process group (no Lightning), for core tests."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        # Rank 0 hosts the store: leaving while a peer still reads from it (gloo connects a new group's pairs through
        # it) resets that peer's connection. (A rank that raised leaves at once: the launcher stops the others.)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns each rank's return value."""
    with tempfile.TemporaryDirectory() as out_dir:
        gc.freeze()  # as the fork launcher does: the ranks never walk (nor copy) this process's heap
        try:
            mp.start_processes(
                _worker, args=(world_size, _free_port(), out_dir, fn, args), nprocs=world_size, start_method="fork"
            )
        finally:
            gc.unfreeze()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
