"""Count the bytes this rank hands to other ranks in ``torch.distributed`` collectives, from the operators themselves.

:class:`CollectiveBytes` is a ``TorchDispatchMode``: every collective issued while it is active, through any
wrapper and in the backward pass too, reaches it as a ``c10d`` operator with its tensors, split sizes and process
group. It records what each one takes from this rank for the other ranks of the group (this rank's own piece
stays local), which is the traffic a token dispatcher's ``sent_bytes`` claims and the benchmark reports.

Bytes are the logical payload: an all-gather sends this rank's input to each of the ``n - 1`` others, a
reduce-scatter sends the ``n - 1`` pieces meant for the others, an all-to-all the rows of the other ranks'
splits. An all-reduce is counted as a ring's ``2 (n - 1) / n`` of the tensor, a broadcast as the root's
``(n - 1)`` copies. Collectives of other kinds are listed in ``unknown``, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# TorchDispatchMode is the documented way to see every operator below autograd (FlopCounterMode is built on it).
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank took part in."""

    op: str
    """The c10d operator (``alltoall_base_``, ``_allgather_base_``, ...)."""
    group: str
    """Name of its process group (``ProcessGroup.group_name``)."""
    group_size: int
    """Ranks in that group."""
    sent_bytes: int
    """Bytes this rank handed to the other ranks of the group."""
    row_width: int
    """Last dimension of the tensor sent (tells ``[tokens, hidden]`` rows from smaller routing metadata)."""


class CollectiveBytes(TorchDispatchMode):
    """``with CollectiveBytes() as sent: ...`` then ``sent.total()``: bytes this rank sent to other ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []
        """A :class:`CollectiveRecord` per collective, in issue order."""
        self.unknown: list[str] = []
        """Names of c10d operators seen but not counted."""

    def total(self, groups: Optional[set] = None) -> int:
        """Bytes sent in every recorded collective, or only in those over the process groups named in ``groups``."""
        return sum(r.sent_bytes for r in self.records if groups is None or r.group in groups)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._record(func._opname, list(args) + list((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))

    def _record(self, op: str, args: list) -> None:
        pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        if pg is None or op == "barrier":
            return
        group = dist.ProcessGroup.unbox(pg)
        n, rank = group.size(), group.rank()
        sent, width = _sent_bytes(op, args, n, rank)
        if sent is None:
            self.unknown.append(op)
            return
        self.records.append(CollectiveRecord(op, group.group_name, n, sent, width))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _width(tensor: torch.Tensor) -> int:
    return int(tensor.shape[-1]) if tensor.dim() else 1


def _sent_bytes(op: str, args: list[Any], n: int, rank: int) -> tuple[Optional[int], int]:
    """(bytes this rank sends, width of its rows) for c10d operator ``op`` called with ``args``."""
    if op == "_allgather_base_":  # (output, input, ...)
        return (n - 1) * _nbytes(args[1]), _width(args[1])
    if op in ("allgather_", "allgather_into_tensor_coalesced_"):  # (outputs, inputs: list, ...)
        return (n - 1) * sum(_nbytes(t) for t in args[1]), _width(args[1][0])
    if op == "_reduce_scatter_base_":  # (output, input, ...): every piece but this rank's own
        return _nbytes(args[1]) - _nbytes(args[0]), _width(args[1])
    if op == "reduce_scatter_tensor_coalesced_":
        return sum(_nbytes(i) - _nbytes(o) for o, i in zip(args[0], args[1])), _width(args[1][0])
    if op == "alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        source, splits = args[1], list(args[4])
        if not splits:  # equal splits
            return _nbytes(source) * (n - 1) // n, _width(source)
        row = _nbytes(source) // max(source.shape[0], 1)
        return (sum(splits) - splits[rank]) * row, _width(source)
    if op == "alltoall_":  # (outputs, inputs: one per rank, ...)
        return sum(_nbytes(t) for j, t in enumerate(args[1]) if j != rank), _width(args[1][0])
    if op in ("allreduce_", "allreduce_coalesced_"):  # a ring all-reduce: a reduce-scatter then an all-gather
        return 2 * (n - 1) * sum(_nbytes(t) for t in args[0]) // n, _width(args[0][0])
    if op == "broadcast_":  # (tensors, group, root_rank, ...)
        return ((n - 1) * sum(_nbytes(t) for t in args[0]) if rank == args[2] else 0), _width(args[0][0])
    if op == "send":
        return sum(_nbytes(t) for t in args[0]), _width(args[0][0])
    if op == "recv_":
        return 0, _width(args[0][0])
    return None, 0
