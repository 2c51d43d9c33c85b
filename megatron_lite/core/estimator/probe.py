"""Measure activation memory: the bytes one forward leaves alive for the backward pass.

Runs on any device (CPU included) without a memory allocator's statistics. Two views of the same
thing, each adding up distinct *storages* (a view -- ``v`` cut out of the fused QKV output, a
transposed weight -- shares its base's storage and keeps all of it allocated, so each storage is
counted once, whole):

* :func:`measure_saved_tensors`: every tensor an operation saves for backward, seen through
  :func:`torch.autograd.graph.saved_tensors_hooks`; it tells *which op* keeps what.
* :func:`measure_retained_tensors`: every storage an operator created during the forward that is
  still alive after it (a ``TorchDispatchMode`` keeps weak references). Unlike the hooks it also sees
  what a non-reentrant ``torch.utils.checkpoint`` region holds (its inputs), so it measures
  activation recompute too; :func:`measure_activation_bytes` uses it.
* :class:`ScheduleActivationProbe`: the same tracking across every stage forward of a pipeline
  schedule, with what stages send and receive, for the per-stage estimate.

Excluded: the model's parameters and buffers (weights are accounted for separately), the caller's
inputs (the batch) and the forward's output. Included: everything else the graph holds, e.g. the
autocast's low-precision copies of the weights (saved by the matmuls, alive until backward), dropout
masks, the softmax of the loss. Temporaries freed during the forward are not counted: this is the
memory held at the end of the forward, the activation part of the peak (the backward adds its own
transient buffers on top).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

# TorchDispatchMode is the documented way to see every operator below autograd (FlopCounterMode is built on it).
from torch.utils._python_dispatch import TorchDispatchMode

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
    peak_bytes: Optional[int] = None
    """Most bytes alive at once during the forward, transients included (:func:`measure_retained_tensors` only)."""

    def bytes_by_dtype(self) -> dict:
        """Total bytes per dtype name, e.g. ``{"float32": ..., "bfloat16": ...}``."""
        out: dict = defaultdict(int)
        for s in self.storages:
            out[str(s.dtype).removeprefix("torch.")] += s.nbytes
        return dict(out)


def _storage_key(t: object):
    """(device, data pointer) of ``t``'s storage and its size; None for tensors without one (meta, sparse) and
    for what is not a tensor (any leaf of a model's output)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def _call(model: nn.Module, inputs: ModelInputs) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _excluded_storages(model: nn.Module, inputs: ModelInputs) -> set:
    """Storages that are not activations: parameters, buffers, and the batch the caller holds."""
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves(inputs)]
    return {key[0] for key in map(_storage_key, tensors) if key is not None}


def measure_saved_tensors(model: nn.Module, inputs_fn: Callable[[], ModelInputs]) -> SavedTensorsReport:
    """Every storage that one forward of ``model`` on ``inputs_fn()`` saves for backward.

    ``inputs_fn()`` returns the model's arguments: a tensor, a tuple/list (positional) or a dict
    (keyword). Autocast or any other context the caller has entered applies to the forward. The
    graph is released before returning (no backward runs). Tensors kept by a non-reentrant
    ``torch.utils.checkpoint`` region (its inputs) bypass these hooks: with activation recompute,
    use :func:`measure_retained_tensors`.
    """
    inputs = inputs_fn()
    excluded = _excluded_storages(model, inputs)
    seen: dict = {}

    def pack(t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is not None and key[0] not in excluded and key[0] not in seen:
            seen[key[0]] = SavedStorage(nbytes=key[1], dtype=t.dtype, shape=tuple(t.shape))
        return t  # keeping the tensor keeps its storage (and so its data pointer) alive and unique

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = _call(model, inputs)
    del output  # frees the graph and everything it saved
    storages = list(seen.values())
    return SavedTensorsReport(total_bytes=sum(s.nbytes for s in storages), storages=storages)


class _StorageTracker(TorchDispatchMode):
    """Weak references to every storage an operator returns (below autograd, so the autocast's
    casts, the kernels' own outputs and everything inside checkpointed regions are seen)."""

    def __init__(self, excluded: set) -> None:
        super().__init__()
        self.excluded = excluded
        self.created: dict = {}  # StorageImpl address -> (weak ref, storage key, SavedStorage)
        self.peak = 0

    def alive(self) -> dict:
        """Storage key -> SavedStorage of every tracked storage still allocated (and not excluded)."""
        self.created = {cdata: entry for cdata, entry in self.created.items() if not entry[0].expired()}
        return {key: info for ref, key, info in self.created.values() if key not in self.excluded}

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage while it is alive, though no operator under this mode created it."""
        key = _storage_key(t)
        if key is not None:
            ref = StorageWeakRef(t.untyped_storage())
            self.created.setdefault(
                ref.cdata, (ref, key[0], SavedStorage(nbytes=key[1], dtype=t.dtype, shape=tuple(t.shape)))
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            key = _storage_key(t)
            if key is None:
                continue
            ref = StorageWeakRef(t.untyped_storage())
            known = self.created.get(ref.cdata)
            if known is None or known[0].expired():
                info = SavedStorage(nbytes=key[1], dtype=t.dtype, shape=tuple(t.shape))
                self.created[ref.cdata] = (ref, key[0], info)
        # After each operator: what the forward holds now (its inputs, if no longer referenced, are freed).
        self.peak = max(self.peak, sum(info.nbytes for info in self.alive().values()))
        return out


def measure_retained_tensors(model: nn.Module, inputs_fn: Callable[[], ModelInputs]) -> SavedTensorsReport:
    """Every storage created during one forward of ``model`` on ``inputs_fn()`` that is still alive
    after it, except the output's: what autograd saved plus what checkpointed regions hold (their
    inputs) -- the activation memory with or without recompute -- and the forward's peak (checked
    after every operator; kernels' internal workspaces are not tensors and not seen). Same arguments
    as :func:`measure_saved_tensors`."""
    inputs = inputs_fn()
    tracker = _StorageTracker(_excluded_storages(model, inputs))
    with tracker:
        output = _call(model, inputs)
    tracker.excluded |= {key[0] for key in map(_storage_key, pytree.tree_leaves(output)) if key is not None}
    storages = list(tracker.alive().values())
    del output
    return SavedTensorsReport(total_bytes=sum(s.nbytes for s in storages), storages=storages, peak_bytes=tracker.peak)


def measure_activation_bytes(model: nn.Module, inputs_fn: Callable[[], ModelInputs]) -> int:
    """Activation bytes of one forward of ``model`` on ``inputs_fn()``: the storages it leaves alive
    for backward, each counted once (see :func:`measure_retained_tensors`)."""
    return measure_retained_tensors(model, inputs_fn).total_bytes


class ScheduleActivationProbe:
    """The activation bytes one pipeline rank holds across a training step's schedule, measured.

    Wrap every stage forward of the step with :meth:`forward`. Counted while alive: every storage an
    operator creates inside those forwards (what autograd saves, checkpoint inputs, the activations sent
    to the next stage), the activations received from the previous stage and the input gradients sent
    back to it. Not counted: parameters, buffers, the microbatches, and transients of the backwards
    (nothing is tracked while they run; what they free is seen).
    """

    def __init__(self, model: nn.Module) -> None:
        self._tracker = _StorageTracker(_excluded_storages(model, ()))
        self.held_bytes = 0
        """Most bytes alive at the end of a forward (what the forwards hold for the backwards)."""
        self.held_storages: list = []
        """The storages alive when ``held_bytes`` was reached (:class:`SavedStorage`)."""

    @property
    def peak_bytes(self) -> int:
        """Most bytes alive after any operator of a forward (the loss computation's transients included)."""
        return self._tracker.peak

    def forward(self, fn: Callable[[], Any], microbatch: ModelInputs, input_tensor: Optional[torch.Tensor]) -> Any:
        """``fn()`` (one stage's forward of ``microbatch`` on ``input_tensor``, None on the first stage), tracked."""
        tracker = self._tracker
        tracker.excluded |= {key[0] for key in map(_storage_key, pytree.tree_leaves(microbatch)) if key is not None}
        if input_tensor is not None:
            tracker.track(input_tensor)
            if input_tensor.requires_grad and input_tensor.is_leaf:
                # The gradient sent back to the previous stage (held by the send until the step ends).
                input_tensor.register_post_accumulate_grad_hook(lambda t: tracker.track(t.grad))
        with tracker:
            out = fn()
        alive = list(tracker.alive().values())
        if sum(info.nbytes for info in alive) > self.held_bytes:
            self.held_bytes, self.held_storages = sum(info.nbytes for info in alive), alive
        return out


@dataclass
class StepActivationReport:
    """Activation bytes of one training step (forward and backward) of a model."""

    held_bytes: int
    """Kept alive for the backward at the end of the forward (as :func:`measure_activation_bytes`)."""
    forward_peak_bytes: int
    """Most bytes alive after any operator of the forward."""
    step_peak_bytes: int
    """Most bytes alive after any operator of the forward or the backward (the backward's transients:
    activation gradients, recomputed tensors, a blockwise attention's per-block probabilities)."""


def measure_step_activations(
    model: nn.Module,
    inputs_fn: Callable[[], ModelInputs],
    reduce: Callable[[Any], torch.Tensor] = lambda out: out.float().sum(),
) -> StepActivationReport:
    """Run one forward of ``model`` on ``inputs_fn()`` and the backward of ``reduce(output)``, tracking every
    storage the operators create (as :func:`measure_retained_tensors`, the backward included; inputs that
    require grad get theirs). Not counted: parameters, buffers, the inputs and the parameters' gradients
    (accumulated into zero buffers made beforehand; the gradients the model held are put back after)."""
    inputs = inputs_fn()
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        tracker = _StorageTracker(
            _excluded_storages(model, inputs)
            | {key[0] for key in map(_storage_key, [p.grad for p in params]) if key is not None}
        )
        with tracker:
            output = _call(model, inputs)
            outputs = {key[0] for key in map(_storage_key, pytree.tree_leaves(output)) if key is not None}
            held = sum(info.nbytes for key, info in tracker.alive().items() if key not in outputs)
            forward_peak = tracker.peak
            reduce(output).backward()
            del output
        return StepActivationReport(held_bytes=held, forward_peak_bytes=forward_peak, step_peak_bytes=tracker.peak)
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad
