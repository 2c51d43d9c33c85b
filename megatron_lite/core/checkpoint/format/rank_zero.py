"""File-system steps of a checkpoint that rank 0 does alone, with the outcome shared with every rank.

A step that fails on rank 0 (a refused metadata value, a path that is not a checkpoint) must fail on every
rank with the same message; otherwise the other ranks would wait for rank 0 in the next collective.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from megatron_lite.core.checkpoint.errors import SHARED_ACROSS_RANKS

T = TypeVar("T")
_SHARED = {error.__name__: error for error in SHARED_ACROSS_RANKS}


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_rank0() -> bool:
    return not distributed() or dist.get_rank() == 0


def on_rank0(step: Callable[[], T], share: bool = True, group: Optional[dist.ProcessGroup] = None) -> T:
    """Run ``step`` on rank 0; every rank returns its result (``share=False``: None elsewhere) or raises
    its error (as the same type when it is one of ours or a FileNotFoundError/ValueError/TypeError).
    ``group`` (holding every rank) carries the outcome instead of the default group: a background
    checkpoint writer has its own, so its collectives never interleave with training's."""
    if not distributed():
        return step()
    outcome: list[Any] = [None]
    error: BaseException | None = None
    result: Any = None
    if dist.get_rank() == 0:
        try:
            result = step()
            outcome = [("ok", result if share else None)]
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
            outcome = [("error", type(exc).__name__, str(exc))]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if error is not None:
        raise error
    if outcome[0][0] == "error":
        _, kind, message = outcome[0]
        raise _SHARED.get(kind, RuntimeError)(f"{message} (raised on rank 0)")
    return result if dist.get_rank() == 0 else outcome[0][1]


def gather_to_all(value: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's ``value``, on every rank (a list of one without a process group); ``group`` as in
    :func:`on_rank0`."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out
