"""Asynchronous checkpoint saves: training goes on while the files are written.

:class:`AsyncCheckpointWriter` saves the same checkpoint as
:func:`~megatron_lite.core.checkpoint.format.sharded.save_sharded`
in three parts:

1. In the calling (training) thread, on every rank: wait for the previous save; encode the metadata and
   create the temporary directory (:func:`~megatron_lite.core.checkpoint.format.sharded.begin_save`); copy every
   tensor of the state (the staging: a snapshot that later optimizer steps cannot change -- on CPU a
   clone, on GPU a copy to host memory); hand the copy to ``torch.distributed.checkpoint.async_save``.
   Only this part blocks training.
2. In DCP's background thread: the DCP write (planning, the files, DCP's ``.metadata``).
3. In this writer's background thread, once the write returned: every rank's outcome and file records
   are gathered; only if every rank wrote its files does rank 0 write the manifest, move the directory
   into place and (a training save) record it as latest
   (:func:`~megatron_lite.core.checkpoint.format.sharded.finish_save`). So
   ``ckpt_path="last"`` and ``latest_checkpoint.json`` only ever name a finished checkpoint, and a kill
   at any point leaves the previous one.

Removals (ModelCheckpoint's top-k) asked for while a save is in flight are done by rank 0 after that save
committed, and not at all if it failed: an older checkpoint is never deleted before its successor exists.

The background collectives (DCP's and ours) run over a process group of their own (gloo, every rank):
on the default group they would interleave with the training thread's collectives in an order that
differs between ranks, which gloo cannot tell apart (a hang or crossed messages).

Why not Lightning's ``AsyncCheckpointIO``: it runs a ``CheckpointIO.save_checkpoint`` of one rank's
dictionary in a thread; a DCP save is a collective over all ranks (planning, deduplication, metadata), our
commit needs every rank's write to have finished, and neither the strategy's ``save_checkpoint`` nor its
``remove_checkpoint`` go through a ``CheckpointIO``.

Errors: a failure of any rank's write (or of the commit) is raised on every rank by :meth:`wait`, which the
next save, the end of ``fit`` and the teardown call -- as an :class:`AsyncCheckpointError` naming the
checkpoint, the rank and the original error (chained as ``__cause__`` where it is this rank's). A full disk
is named as such, with the bytes needed and free (:mod:`~megatron_lite.core.checkpoint.format.disk_space`); the
unfinished save is removed and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from megatron_lite.core.checkpoint.errors import AsyncCheckpointError
from megatron_lite.core.checkpoint.format.disk_space import disk_full_cause, disk_full_error, tensor_bytes
from megatron_lite.core.checkpoint.format.integrity import ChecksummingWriter, checksumming_writer
from megatron_lite.core.checkpoint.format.rank_zero import distributed, gather_to_all, is_rank0
from megatron_lite.core.checkpoint.format.sharded import (
    SaveTarget,
    begin_save,
    dcp_error,
    finish_save,
    remove_checkpoint,
)
from megatron_lite.core.object_store import Location, location

log = logging.getLogger(__name__)


def stage(value: Any) -> Any:
    """A copy of a (nested) state dict whose tensors share nothing with the live ones, in host memory.

    DTensors keep their mesh, placements and global shape (with a copied local tensor, or copied shards of
    a ``LocalShardsWrapper``), so DCP writes the copy exactly as it would have written the original."""
    if isinstance(value, dict):
        return {k: stage(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(stage(v) for v in value)
    if not torch.is_tensor(value):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = _copy_local(value.to_local())
        return DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    return _copy_local(value)


def _copy_local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if isinstance(tensor, LocalShardsWrapper):
        shards = [s.detach().to("cpu", copy=True) for s in tensor.local_shards()]
        return LocalShardsWrapper(shards, [tuple(o) for o in tensor.local_offsets()])
    return tensor.detach().to("cpu", copy=True)


class _StagedAlready(AsyncStager):
    """DCP's stager protocol for a state dict this writer has staged itself (so DCP copies nothing again)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class _Job:
    target: SaveTarget
    tensor_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes of this rank's tensors by key (what a full disk's error reports as needed)."""
    future: Optional[Future] = None
    """The background commit (set right after the job is submitted, before anything else reads it)."""
    removals: list[Location] = dataclasses.field(default_factory=list)
    outcome: str = "writing"
    """"writing", then "committed" or "failed" (set under the writer's lock with the removals taken)."""


class AsyncCheckpointWriter:
    """Saves checkpoints in the background, one at a time (see the module docstring). Collective: every
    rank calls :meth:`save`, :meth:`wait` and :meth:`close` in the same order."""

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._job: Optional[_Job] = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> Optional[Location]:
        """The checkpoint being written, if one is (until :meth:`wait` returned)."""
        return self._job.target.path if self._job is not None else None

    def save(
        self,
        state: dict[str, Any],
        path: str | os.PathLike,
        extra: Optional[dict] = None,
        allowed: Sequence[type] = (),
        latest: bool = False,
    ) -> Location:
        """Wait for the previous save (raising its error), then start writing ``state`` and ``extra`` to
        ``path`` as :func:`~megatron_lite.core.checkpoint.format.sharded.save_sharded` would (``latest`` as
        there); returns once the tensors are staged."""
        self.wait()
        target = begin_save(path, extra, allowed, latest=latest)
        staged = stage(state)
        group = self._checkpoint_group()
        writer = checksumming_writer(target.tmp)
        written = dcp.async_save(staged, storage_writer=writer, process_group=group, async_stager=_StagedAlready())
        assert isinstance(written, Future)  # a stager that returns the state dict itself: the upload's future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-lite-checkpoint")
        job = _Job(target, tensor_bytes(state))
        job.future = self._executor.submit(self._finish, job, written, writer, group)
        self._job = job
        return target.path

    def remove(self, path: str | os.PathLike) -> None:
        """Remove a checkpoint (rank 0's part of a top-k removal): now, or after the save in flight
        committed -- never while it may still fail, and never if it did."""
        with self._lock:
            job = self._job
            outcome = job.outcome if job is not None else "committed"
            if job is not None and outcome == "writing":
                job.removals.append(location(path))
                return
        if outcome == "failed":
            log.warning("megatron-lite: kept %s: the save meant to replace it failed", path)
            return
        remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error (the same on every rank)."""
        job, self._job = self._job, None
        if job is not None and job.future is not None:
            job.future.result()

    def close(self, raise_error: bool = True) -> None:
        """Wait for the save in flight, then release the background thread and process group.
        ``raise_error=False`` (a run already failing): a failed save is logged instead of raised."""
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
            if raise_error:
                raise
            log.error("megatron-lite: the checkpoint being written in the background failed: %s", error)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._group is not None and distributed():
                dist.destroy_process_group(self._group)
            self._group = None

    # --- internals ------------------------------------------------------------------------
    def _checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        # Created at the first save, which every rank makes at the same point (new_group is collective).
        if self._group is None and distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _finish(
        self, job: _Job, written: Future, writer: ChecksummingWriter, group: Optional[dist.ProcessGroup]
    ) -> None:
        """In the background thread: every rank's outcome, then the commit only if all wrote their files."""
        path = job.target.path
        failure = full = None
        try:
            written.result()
        except CheckpointException as error:
            failure, full = dcp_error(error, f"writing {path}"), disk_full_cause(error)
        except Exception as error:  # noqa: BLE001 - shared with every rank below
            failure, full = error, disk_full_cause(error)
        outcome = (
            None
            if failure is None
            else (
                f"{type(failure).__name__}: {failure}",
                None if full is None else (full.errno, full.strerror, full.filename),
            )
        )
        failed = [(rank, o) for rank, o in enumerate(gather_to_all(outcome, group)) if o is not None]
        if failed:
            self._drop_removals(job)
            disk_full = [o[1] for _, o in failed if o[1] is not None]
            # every rank sees the same outcomes, so all of them make this collective call (a store is never full)
            if disk_full and isinstance(path, Path) and isinstance(job.target.tmp, Path):
                full_error = disk_full_error(path, job.target.tmp, OSError(*disk_full[0]), job.tensor_bytes, group)
                raise AsyncCheckpointError(
                    f"the checkpoint {path} could not be written in the background: {full_error}"
                ) from full_error
            rank, (message, _) = failed[0]
            raise AsyncCheckpointError(
                f"the checkpoint {path} could not be written in the background (rank {rank}: {message}); "
                f"it was not committed and the previous checkpoint is still the latest. Check that the "
                f"checkpoint directory is writable and has space."
            ) from failure
        try:
            finish_save(job.target, writer.records, group)
        except Exception as error:
            self._drop_removals(job)
            raise AsyncCheckpointError(
                f"the checkpoint {path} was written but could not be committed: {type(error).__name__}: {error}"
            ) from error
        with self._lock:
            job.outcome = "committed"
            removals, job.removals = job.removals, []
        for old in removals:
            if is_rank0():
                remove_checkpoint(old)

    def _drop_removals(self, job: _Job) -> None:
        with self._lock:
            job.outcome = "failed"
            if job.removals:
                log.warning(
                    "megatron-lite: kept %s: the save meant to replace it failed",
                    ", ".join(str(p) for p in job.removals),
                )
            job.removals = []
