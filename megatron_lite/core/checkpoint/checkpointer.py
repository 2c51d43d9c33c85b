"""The Checkpointer: a training run's state saved as one of our checkpoints, and loaded back, in the foreground or
in the background.

A run's checkpoint holds (docs/checkpoint-format.md):

- the module's parameters and persistent buffers under ``model.``, as global tensors (:mod:`.state`);
- each optimizer's state under ``optimizer_<i>.``, keyed by parameter names whatever the layout or ZeRO-1
  sharding (a :class:`~megatron_lite.core.optim.MegatronOptimizer` in the first one's place, with its fp32
  masters, loss scaler and skipped steps), and the param groups' hyperparameters in ``meta.json``
  (``optimizer_param_groups``);
- every rank's RNG states, with the layout they were drawn in (:mod:`.resume.rng`), and the layout record
  (``megatron_lite_layout``);
- what the caller hands over as ``meta`` (with Lightning: its loops, LR schedulers, hyperparameters, ...).

It is given once what it saves -- the module, the optimizers, the layout -- and knows nothing of Lightning:
``MegatronStrategy`` turns Lightning's checkpoint dict into :meth:`Checkpointer.save`'s arguments and
:class:`Loaded` back into what Lightning restores. Saves run one at a time; a background save (``asynchronous``)
is waited for by the next save, :meth:`~Checkpointer.wait` and :meth:`~Checkpointer.close`, which raise its error.
Every method is collective: every rank makes the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Collection, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from megatron_lite.core.checkpoint.errors import EntryMismatchError
from megatron_lite.core.checkpoint.format.async_save import AsyncCheckpointWriter
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.rank_zero import gather_to_all
from megatron_lite.core.checkpoint.format.sharded import (
    checkpoint_keys,
    load_sharded,
    remove_checkpoint,
    resolve_checkpoint,
    save_sharded,
)
from megatron_lite.core.checkpoint.resume.entries import (
    MODEL_STATE,
    EntryMismatch,
    checkpoint_model_entries,
    compare_entries,
    refuse_quantized_into_plain,
)
from megatron_lite.core.checkpoint.resume.rng import (
    derived_cpu_generator_state,
    layout_mismatch,
    rederive_rng_state,
    restore_rng_state,
    rng_placeholders,
    rng_state,
    saved_cpu_generator_state,
)
from megatron_lite.core.checkpoint.state import (
    WriteBacks,
    ensure_optimizer_state,
    load_optimizer_groups,
    megatron_optimizer_load_state,
    megatron_optimizer_state,
    sharded_model_state,
    sharded_optimizer_state,
    write_back,
)
from megatron_lite.core.object_store import Location, location
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.timers import Timers, timed

log = logging.getLogger(__name__)

PARAM_GROUPS = "optimizer_param_groups"
"""The ``meta.json`` entry holding each optimizer's param-group hyperparameters (a list per optimizer)."""
LAYOUT_RECORD = "megatron_lite_layout"
"""The ``meta.json`` entry recording the layout a checkpoint was written with (:func:`layout_record`)."""


def layout_record(layout: ParallelLayout, fsdp: bool = False) -> dict[str, Any]:
    """What a checkpoint records of the layout that wrote it (``world_size``: the ranks whose RNG states it holds)."""
    config = layout.config
    return {
        "tensor_model_parallel_size": config.tensor_model_parallel_size,
        "sequence_parallel": config.sequence_parallel,
        "pipeline_model_parallel_size": config.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": config.virtual_pipeline_model_parallel_size,
        "world_size": layout.world_size,
        "context_parallel_size": config.context_parallel_size,
        "expert_model_parallel_size": config.expert_model_parallel_size,
        "data_parallel_size": layout.dp_size,
        "use_torch_fsdp2": fsdp,
    }


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What :meth:`Checkpointer.load` read besides the tensors it loaded in place."""

    path: Location
    """The checkpoint directory that was loaded (in an object store: the prefix of its files)."""
    meta: dict[str, Any]
    """The save's ``meta`` (with Lightning: its checkpoint dict without the tensors), with the param groups and the
    layout record the Checkpointer added."""
    mismatch: EntryMismatch
    """The module's entries the checkpoint lacks and the checkpoint's the module lacks (only with ``strict=False``;
    those entries were not loaded). Empty when they are the same."""
    cpu_rng_state: Optional[torch.Tensor] = None
    """With ``restore_cpu_rng=False``: the global CPU generator's state for the caller to set before the next step."""


class Checkpointer:
    """Saves and loads ``module`` (its tensors and the RNG streams of its sub-modules), ``optimizers`` and the RNG
    states of this rank at ``layout``.

    Args:
        module: what the checkpoint's ``model.`` entries are the tensors of (a LightningModule, or any module).
        layout: this rank's layout (one process when None).
        optimizers: the torch optimizers whose state is saved, in order (``optimizer_0``, ...).
        megatron_optimizer: the core optimizer wrapping the first of them (fp32 masters, ZeRO-1, loss scaler): its
            state is saved in that one's place; given alone, its ``optimizer`` is the first.
        allowed: config dataclasses ``meta`` may hold besides the default ones (see ``format.meta_json``).
        fsdp: the module's parameters are sharded with FSDP2 (recorded in the layout record).
        timers: Megatron timers that time each save (``save-checkpoint``), if the run keeps them.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: Optional[ParallelLayout] = None,
        optimizers: Sequence[Optimizer] = (),
        *,
        megatron_optimizer: Any = None,
        allowed: Sequence[type] = (),
        fsdp: bool = False,
        timers: Optional[Timers] = None,
    ) -> None:
        self.module = module
        self.layout = layout if layout is not None else ParallelLayout.single()
        self.megatron_optimizer = megatron_optimizer
        self.optimizers = list(optimizers) or ([megatron_optimizer.optimizer] if megatron_optimizer is not None else [])
        self.allowed = list(allowed)
        self.fsdp = fsdp
        self.timers = timers
        self._writer: Optional[AsyncCheckpointWriter] = None

    @property
    def pending(self) -> Optional[Location]:
        """The checkpoint being written in the background, if one is (until :meth:`wait` returned)."""
        return self._writer.pending if self._writer is not None else None

    # --- state ----------------------------------------------------------------------------
    def model_state(self, writebacks: Optional[WriteBacks] = None) -> dict[str, Any]:
        """The module's parameters and persistent buffers as DCP entries (views of the live tensors)."""
        return sharded_model_state(self.module, self.layout, writebacks)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state as DCP entries, with its ``param_groups`` (the core optimizer's, if there is one)."""
        mopt = self.megatron_optimizer
        if mopt is not None:
            return megatron_optimizer_state(mopt, self.layout, self._megatron_prefix())
        return sharded_optimizer_state(self.module, optimizer, self.layout)

    # --- saving ---------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike,
        meta: Optional[dict[str, Any]] = None,
        *,
        model_state: Optional[dict[str, Any]] = None,
        optimizer_states: Optional[Sequence[dict]] = None,
        asynchronous: bool = False,
        latest: bool = True,
    ) -> Location:
        """Save the run's state and ``meta`` as the checkpoint ``path`` (a directory, or an object store's URL); returns
        ``path`` (as a :data:`~megatron_lite.core.object_store.Location`).

        ``model_state`` / ``optimizer_states``: the entries to save instead of :meth:`model_state` and every
        optimizer's :meth:`optimizer_state` (what Lightning's checkpoint dict holds; ``[]``: no optimizer state).
        ``asynchronous``: return once the tensors are copied to host memory; the files are written and committed in
        the background (:meth:`wait`). ``latest``: record it as its directory's latest checkpoint, which loading the
        directory takes. ``meta["global_step"]``, when there, is recorded with it.
        """
        path = location(path)
        meta = dict(meta) if meta is not None else {}
        state: dict[str, Any] = {MODEL_STATE: model_state if model_state is not None else self.model_state()}
        if optimizer_states is None:
            optimizer_states = [self.optimizer_state(optimizer) for optimizer in self.optimizers]
        groups = []
        for index, optimizer_state in enumerate(optimizer_states):
            optimizer_state = dict(optimizer_state)
            groups.append(optimizer_state.pop("param_groups"))  # hyperparameters: meta.json, not DCP
            state[_optimizer_key(index)] = optimizer_state
        meta[PARAM_GROUPS] = groups
        meta[LAYOUT_RECORD] = layout_record(self.layout, self.fsdp)
        state.update(rng_state(self.module, self.layout.rank, self.layout))
        with timed(self.timers, "save-checkpoint", log_level=0):
            if asynchronous:
                if self._writer is None:
                    self._writer = AsyncCheckpointWriter()
                self._writer.save(state, path, extra=meta, allowed=self.allowed, latest=latest)
            else:
                self.wait()  # saves land in the order they were asked for
                save_sharded(state, path, extra=meta, allowed=self.allowed, latest=latest)
        return path

    def remove(self, path: str | os.PathLike) -> None:
        """Remove a checkpoint (the top-k ones a run no longer keeps): renamed away at once, then deleted, so a kill
        mid-removal never leaves a half-deleted checkpoint under its name. While a save is in flight the removal
        waits until that save is committed (and is dropped if it fails): an older checkpoint is never gone before
        the newer one exists. Call it on every rank; rank 0 removes."""
        if self.layout.rank != 0:
            return
        if self._writer is not None:
            self._writer.remove(path)
        else:
            remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the checkpoint being written in the background is committed; raise its error."""
        if self._writer is not None:
            self._writer.wait()

    def close(self, raise_error: bool = True) -> None:
        """Wait for the save in flight, then release the background writer (its thread and process group).
        ``raise_error=False`` (a run already failing): a failed save is logged instead of raised."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close(raise_error=raise_error)

    # --- loading --------------------------------------------------------------------------
    def load(
        self,
        path: str | os.PathLike,
        *,
        optimizers: bool = True,
        rng: bool = True,
        strict: bool = True,
        verify: bool = True,
        restore_cpu_rng: bool = True,
        provided: Collection[str] = (),
    ) -> Loaded:
        """Load the checkpoint ``path`` into the module (and, with ``optimizers``, the optimizers; with ``rng``, the
        RNG states) in place.

        ``strict``: the module's entries and the checkpoint's must be the same set, on all ranks together
        (:class:`~megatron_lite.core.checkpoint.errors.EntryMismatchError` on every rank otherwise); without, the
        entries both have are loaded and :attr:`Loaded.mismatch` names the others. ``verify``: resolve ``path``
        (a directory of checkpoints: its latest) and check every file against its checksum first (False: the
        caller did both). The RNG states are restored where the checkpoint was written at this very layout, else
        re-derived from the seeds for ``meta["global_step"]``; ``restore_cpu_rng=False`` leaves the global CPU
        generator to the caller (:attr:`Loaded.cpu_rng_state`). ``provided``: the module's entries the checkpoint may
        lack because the module holds them already (the frozen base under an adapter-only LoRA checkpoint); those
        it lacks are neither loaded nor missing.
        """
        path = location(path)
        if verify:
            path = resolve_checkpoint(path)
            verify_checkpoint(path)
        keys = checkpoint_keys(path)
        refuse_quantized_into_plain(self.module, path, keys)
        writebacks: WriteBacks = []
        model_state, mismatch = self._entries_to_load(path, keys, strict, writebacks, provided)
        state: dict[str, Any] = {MODEL_STATE: model_state}
        finish: Optional[Callable[[dict[str, Any]], None]] = None
        for index, optimizer in enumerate(self.optimizers if optimizers else []):
            key = _optimizer_key(index)
            if index == 0 and self.megatron_optimizer is not None:
                self.megatron_optimizer.ensure_state()
                optimizer_state, finish = megatron_optimizer_load_state(
                    self.megatron_optimizer, self.layout, keys, key + ".", self._megatron_prefix(), writebacks
                )
            else:
                ensure_optimizer_state(optimizer)
                optimizer_state = sharded_optimizer_state(self.module, optimizer, self.layout)
                if not strict:  # the state of parameters the checkpoint lacks stays as it is
                    optimizer_state = {
                        k: v for k, v in optimizer_state.items() if k == "param_groups" or f"{key}.{k}" in keys
                    }
            optimizer_state.pop("param_groups")
            state[key] = optimizer_state
        saved_rng = rng_placeholders(path, self.layout.rank) if rng else {}
        state.update(saved_rng)
        meta = load_sharded(state, path, allowed=self.allowed, verify=False)
        write_back(writebacks)
        if finish is not None:
            finish(state[_optimizer_key(0)])
        for optimizer, groups in zip(self.optimizers if optimizers else [], meta.get(PARAM_GROUPS, [])):
            load_optimizer_groups(optimizer, groups)
        cpu_rng_state = None
        if rng:
            cpu_rng_state = self._restore_or_rederive_rng(
                {k: state[k] for k in saved_rng}, int(meta.get("global_step", 0))
            )
            if restore_cpu_rng and cpu_rng_state is not None:
                torch.set_rng_state(cpu_rng_state)
                cpu_rng_state = None
        return Loaded(path, meta, mismatch, cpu_rng_state)

    # --- internals ------------------------------------------------------------------------
    def _megatron_prefix(self) -> str:
        """Where the core optimizer's model sits in the module (``"model."`` in a GPTModule): its parameters' names
        in the checkpoint are the module's."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        for name, param in self.megatron_optimizer.named_params:
            if id(param) in names:
                return names[id(param)][: -len(name)]
        return ""

    def _entries_to_load(
        self, path: Location, keys: set[str], strict: bool, writebacks: WriteBacks, provided: Collection[str] = ()
    ) -> tuple[dict[str, Any], EntryMismatch]:
        """This rank's model entries to load from ``path``. Their names on every rank together (a pipeline stage holds
        only its layers), less the ``provided`` ones the checkpoint lacks, must be the checkpoint's: otherwise, with
        ``strict``, one error on every rank; without, the entries both have."""
        saved = checkpoint_model_entries(path, keys)
        provided = set(provided) - saved
        model_state = {name: value for name, value in self.model_state(writebacks).items() if name not in provided}
        ours = set().union(*gather_to_all(sorted(model_state)))
        mismatch = compare_entries(ours, saved)
        if not mismatch:
            return model_state, mismatch
        if strict:
            raise EntryMismatchError(
                f"the checkpoint {path} does not hold the module's entries: {mismatch.describe()}", mismatch
            )
        return {name: value for name, value in model_state.items() if name in saved}, mismatch

    def _restore_or_rederive_rng(self, loaded: dict[str, torch.Tensor], step: int) -> Optional[torch.Tensor]:
        """Restore the saved RNG states only where the checkpoint was written at this very layout (sizes and this
        rank's coordinates, on every rank); otherwise re-derive them from the seeds for ``step``, with one note from
        rank 0 saying why. All ranks take the same branch. Returns the global CPU generator's state, which is
        left to the caller."""
        rank = self.layout.rank
        reason = layout_mismatch(loaded, self.layout, rank)
        if not any(gather_to_all(reason is not None)):
            restore_rng_state(self.module, loaded, rank, cpu_generator=False)
            return saved_cpu_generator_state(loaded, rank)
        rederive_rng_state(self.module, step, cpu_generator=False)
        if rank == 0:  # a warning-level record: visible without any logging set-up
            log.warning(
                f"megatron-lite: RNG states not restored from the checkpoint: "
                f"{reason or 'the layout of another rank changed'}; re-derived from the seeds for step {step} "
                f"(dropout masks differ from those an uninterrupted run at the saved layout would draw)."
            )
        return derived_cpu_generator_state(step)
