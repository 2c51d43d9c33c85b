"""Measure activation memory: the bytes autograd keeps for the backward pass of one forward.

Runs on any device (CPU included) without a memory allocator's statistics: every tensor an
operation saves for backward passes through :func:`torch.autograd.graph.saved_tensors_hooks`, and
we add up the *storages* behind them. Counting storages, not tensors, matters: a view (``q`` cut out
of the fused QKV output, a transposed weight) shares its storage with its base and must be counted
once, at the size of the whole storage, because that is what stays allocated.

Excluded: storages of the model's parameters and buffers (weights are accounted for separately).
Included: everything else that the graph holds, e.g. the input token ids, the autocast's low-precision
copies of the weights (they are saved by the matmuls and live until backward), dropout masks, and the
softmax of the loss. Temporaries that are freed during the forward are *not* counted: this is the
memory held at the end of the forward, which is the activation part of the peak (the peak itself adds
the largest transient buffer of the forward or backward on top).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
from torch import nn

ModelInputs = Union[torch.Tensor, tuple, list, dict]


@dataclass
class SavedStorage:
    """One storage kept alive for backward."""

    nbytes: int
    """Bytes of the whole storage."""
    dtype: torch.dtype
    """Dtype of the first tensor seen on it."""
    shape: tuple
    """Shape of the first tensor seen on it (a view may be smaller than the storage)."""


@dataclass
class SavedTensorsReport:
    """What one forward saved for backward."""

    total_bytes: int
    """Sum of the sizes of the distinct saved storages (parameters and buffers excluded)."""
    storages: list = field(default_factory=list)
    """Every distinct saved storage (:class:`SavedStorage`), in the order first seen."""

    def bytes_by_dtype(self) -> dict:
        """Total bytes per dtype name, e.g. ``{"float32": ..., "bfloat16": ...}``."""
        out: dict = defaultdict(int)
        for s in self.storages:
            out[str(s.dtype).removeprefix("torch.")] += s.nbytes
        return dict(out)


def _storage_key(t: torch.Tensor):
    """(device, data pointer) of ``t``'s storage; None for tensors without one (e.g. meta, sparse)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def measure_saved_tensors(model: nn.Module, inputs_fn: Callable[[], ModelInputs]) -> SavedTensorsReport:
    """Run ``model`` once on ``inputs_fn()`` and report every storage saved for backward.

    ``inputs_fn()`` returns the model's arguments: a tensor, a tuple/list (positional) or a dict
    (keyword). Autocast or any other context the caller has entered applies to the forward. The
    graph is released before returning (no backward runs).
    """
    excluded = set()
    for tensor in (*model.parameters(), *model.buffers()):
        key = _storage_key(tensor)
        if key is not None:
            excluded.add(key[0])
    seen: dict = {}

    def pack(t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is not None and key[0] not in excluded and key[0] not in seen:
            seen[key[0]] = SavedStorage(nbytes=key[1], dtype=t.dtype, shape=tuple(t.shape))
        return t  # keeping the tensor keeps its storage (and so its data pointer) alive and unique

    inputs = inputs_fn()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if isinstance(inputs, dict):
            output = model(**inputs)
        elif isinstance(inputs, (tuple, list)):
            output = model(*inputs)
        else:
            output = model(inputs)
    del output  # frees the graph and everything it saved
    storages = list(seen.values())
    return SavedTensorsReport(total_bytes=sum(s.nbytes for s in storages), storages=storages)


def measure_activation_bytes(model: nn.Module, inputs_fn: Callable[[], ModelInputs]) -> int:
    """Bytes of the tensors saved for backward by one forward of ``model`` on ``inputs_fn()``,
    each storage counted once, parameters and buffers excluded (see :func:`measure_saved_tensors`)."""
    return measure_saved_tensors(model, inputs_fn).total_bytes
