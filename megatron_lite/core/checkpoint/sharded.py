"""Sharded state dicts for DCP, and saving/loading them safely.

A tensor-parallel shard is presented to ``torch.distributed.checkpoint`` as a DTensor over the TP
mesh dimension (Shard along its split dim, with fused blocks seen as an extra dimension), so DCP
writes the global tensor; replicated tensors are plain and DCP keeps one copy. The views share
storage with the live parameters and optimizer state, so loading writes straight into them.

:func:`save_sharded` / :func:`load_sharded` put the pieces of the on-disk format together (see
``docs/checkpoint-format.md``): the non-tensor part as JSON (``meta_json``), checksums recorded while
writing and checked before reading (``integrity``), the atomic commit and recovery (``commit``), and
DCP reads that never unpickle (``safe_reader``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from megatron_lite.core.checkpoint import meta_json
from megatron_lite.core.checkpoint.commit import (
    clean_up,
    commit,
    fsync_dir,
    incomplete_leftovers,
    latest_in,
    record_latest,
    recover,
    sibling,
    write_file_durably,
)
from megatron_lite.core.checkpoint.disk_space import disk_full_cause, disk_full_error, tensor_bytes
from megatron_lite.core.checkpoint.integrity import (
    LEGACY_META,
    MANIFEST,
    META,
    ChecksummingFileSystemWriter,
    CorruptCheckpointError,
    FileRecord,
    manifest_bytes,
    record_bytes,
    verify_checkpoint,
)
from megatron_lite.core.checkpoint.rank_zero import gather_to_all, on_rank0
from megatron_lite.core.checkpoint.safe_reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    read_dcp_metadata,
)
from megatron_lite.core.parallel.fsdp import copy_into_sharded, full_local_tensor, is_dtensor
from megatron_lite.core.parallel.layout import ParallelLayout

# (live tensor, full tensor that DCP loads into): FSDP-sharded tensors are checkpointed through a
# gathered copy, which must be written back into the shard after loading.
WriteBacks = list[tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)

EMBEDDED_FILES = "megatron_lite_embedded_files"
"""Key of a save's ``extra`` naming files to copy into the checkpoint, ``{path inside it: source file}`` (e.g.
``{"tokenizer/tokenizer.model": "/home/me/.cache/.../tokenizer.model"}``), so that it carries them with it: copied
when the save begins, checksummed in the manifest like its other files, never stored in ``meta.json``. Each
path is ``<folder>/<file>``: a folder of its own, so it never collides with the checkpoint's own files."""


def _global_view(tensor: torch.Tensor, param: torch.Tensor, layout: ParallelLayout):
    shard = getattr(param, "tp_shard", None)
    if shard is None:
        return tensor
    if shard.unpadded_size is not None:
        return _real_rows_view(tensor, shard, layout)
    view, global_shape, dim = shard.blocked_view(tensor)
    if shard.size == 1 or layout.mesh is None:
        # Still the blocked view (e.g. [2, ffn, h] for fused gate/up): the saved shape must not
        # depend on the TP size, or a TP1 checkpoint could not be loaded at TP2.
        return view
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(view, layout.mesh["tp"], [Shard(dim)], run_check=False,
                              shape=torch.Size(global_shape), stride=stride)


def _real_rows_view(tensor: torch.Tensor, shard, layout: ParallelLayout):
    """The global view of a vocabulary-padded tensor holds only its real rows (``shard.real_shape``), so a
    checkpoint does not depend on the padding, which depends on the TP size.

    Under TP the real rows are split unevenly -- every rank before the padding holds V_padded/tp of them,
    the rank where the padding starts fewer, later ranks none -- which DTensor's ``Shard`` cannot describe
    (it assumes ``torch.chunk``'s split). The rank's rows are therefore handed to DCP with their explicit
    offset, as a DTensor whose local tensor is a ``LocalShardsWrapper`` (torch's wrapper for shards at given
    offsets, which DTensor delegates DCP's chunk and write-item queries to). Views throughout: loading
    writes straight into the live tensor's real rows, and its padding rows are left as they are (zero).
    """
    dim, real = shard.dim, shard.local_real_size
    local = tensor.narrow(dim, 0, real)
    if shard.size == 1 or layout.mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if real > 0:
        offsets = [0] * tensor.ndim
        offsets[dim] = shard.local_start
        rows = LocalShardsWrapper([local], [tuple(offsets)])
    else:  # this rank holds only padding: nothing of it is written, nothing read into it (the empty
        # wrapper describes a 2-D tensor: vocabulary tensors are [vocab, hidden])
        rows = LocalShardsWrapper([], [])
    global_shape = torch.Size(shard.real_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(rows, layout.mesh["tp"], [Shard(dim)], run_check=False, shape=global_shape,
                              stride=stride)


def _checkpoint_view(tensor: torch.Tensor, param: torch.Tensor, layout: ParallelLayout,
                     writebacks: Optional[WriteBacks]) -> torch.Tensor:
    if is_dtensor(tensor):
        full = full_local_tensor(tensor)
        if writebacks is not None:
            writebacks.append((tensor, full))
        tensor = full
    return _global_view(tensor, param, layout)


def write_back(writebacks: WriteBacks) -> None:
    """After a load: copy the loaded full tensors into their FSDP shards."""
    for live, full in writebacks:
        copy_into_sharded(live, full)


def sharded_model_state(module: nn.Module, layout: ParallelLayout,
                        writebacks: Optional[WriteBacks] = None) -> dict[str, Any]:
    """Parameters (as global views) and persistent buffers of ``module``."""
    state: dict[str, Any] = {}
    for name, param in module.named_parameters():
        state[name] = _checkpoint_view(param.data, param, layout, writebacks)
    for name, buf in module.named_buffers():
        short = name.rsplit(".", 1)[-1]
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if short not in owner._non_persistent_buffers_set:
            # A buffer split over TP like its layer (a quantizer's per-channel amax) carries a tp_shard too
            state[name] = _global_view(buf, buf, layout)
    return state


def sharded_optimizer_state(module: nn.Module, optimizer: Optimizer, layout: ParallelLayout) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (layout-independent), tensors as global views."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = {id(p): p for p in module.parameters()}
    state: dict[str, Any] = {}
    for pid, pstate in ((id(p), optimizer.state.get(p, {})) for g in optimizer.param_groups for p in g["params"]):
        name = names[pid]
        for key, value in pstate.items():
            if torch.is_tensor(value) and value.shape == params[pid].shape and value.ndim > 0:
                value = _global_view(value, params[pid], layout)
            state[f"state.{name}.{key}"] = value
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]})
    state["param_groups"] = groups
    return state


def megatron_optimizer_state(optimizer, params_by_name: dict[str, torch.Tensor], layout: ParallelLayout,
                             per_param: dict[str, dict[str, torch.Tensor]], prefix: str = "",
                             writebacks: Optional[WriteBacks] = None) -> dict[str, Any]:
    """A :class:`megatron_lite.core.optim.MegatronOptimizer`'s state in the same keys as
    :func:`sharded_optimizer_state` (``state.<param name>.<key>``), from its ``checkpoint_state()``,
    plus ``extra`` (loss scaler, skipped steps) and the param groups' hyperparameters."""
    state: dict[str, Any] = {}
    for name, entry in per_param.items():
        param = params_by_name[name]
        for key, value in entry.items():
            if torch.is_tensor(value) and value.ndim > 0:
                value = _checkpoint_view(value, param, layout, writebacks)
            state[f"state.{prefix}{name}.{key}"] = value
    state["extra"] = optimizer.state_dict_extra()
    state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    return state


@torch.no_grad()
def ensure_optimizer_state(optimizer: Optimizer) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and lr 0) so a checkpoint
    can be loaded into them in place."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    saved_grads = [p.grad for p in params]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def load_optimizer_groups(optimizer: Optimizer, groups: list[dict]) -> None:
    """Restore hyperparameters of each param group (lr, betas, ...) saved by sharded_optimizer_state.

    Groups are matched by their (wd_mult, lr_mult) multipliers when they carry them: a ZeRO-1 rank
    holds only the groups its shard touches, so group counts differ between ranks and layouts."""
    def key(group: dict):
        return (group.get("wd_mult"), group.get("lr_mult"))

    if all(key(g) != (None, None) for g in [*groups, *optimizer.param_groups]):
        saved = {key(g): g for g in groups}
        for group in optimizer.param_groups:
            if key(group) in saved:
                group.update({k: v for k, v in saved[key(group)].items() if k != "params"})
        return
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory to load for ``path`` (collective when a process group exists).

    ``path`` itself if it is a checkpoint; the one named by ``latest_checkpoint.json`` if ``path`` is a
    directory of checkpoints; if ``path`` is missing because a save was killed while replacing it, the
    complete sibling left behind is put back first (logged). Anything else raises one clear error, on
    every rank.
    """
    return Path(on_rank0(lambda: str(_resolve(Path(path)))))


def _resolve(path: Path) -> Path:
    if not os.path.lexists(path):
        recover(path)
    if path.is_dir() and not (path / ".metadata").is_file():
        latest = latest_in(path)
        if latest is not None:
            log.info("megatron-lite: %s holds checkpoints; loading the latest one, %s", path, latest.name)
            return latest
    if (path / ".metadata").is_file():
        return path
    if not os.path.lexists(path):
        leftovers = incomplete_leftovers(path)
        hint = (f" Only the unfinished save(s) {', '.join(p.name for p in leftovers)} are there: the save was killed "
                f"before it finished, so load an earlier checkpoint." if leftovers else "")
        raise FileNotFoundError(f"no checkpoint at {path}.{hint}")
    what = "a file" if path.is_file() else "a directory without DCP .metadata"
    raise FileNotFoundError(
        f"{path} is {what}, not a megatron-lite checkpoint; pass the directory that trainer.save_checkpoint() or "
        f"ModelCheckpoint wrote (it holds .metadata, *.distcp, meta.json and manifest.json).")


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """Flattened keys stored in a DCP checkpoint (to load only what it has)."""
    return set(read_dcp_metadata(Path(path) / ".metadata").state_dict_metadata.keys())


def save_sharded(state: dict[str, Any], path: str | os.PathLike, extra: Optional[dict] = None,
                 allowed: Sequence[type] = (), in_flight: Sequence[str | os.PathLike] = ()) -> Path:
    """Write ``state`` with DCP and ``extra`` (the non-tensor part: loops, schedulers, hyperparameters) as
    ``meta.json`` under ``path``, atomically; collective when a process group exists.

    ``extra`` may hold what :mod:`megatron_lite.core.checkpoint.meta_json` encodes, with ``allowed`` as the
    config dataclasses besides the default ones; anything else is refused before a byte is written.
    ``extra[EMBEDDED_FILES]`` names files the checkpoint carries in folders of its own (:data:`EMBEDDED_FILES`). Rank 0
    first recovers or removes leftovers of killed saves next to ``path`` (but not ``in_flight`` ones), then
    every rank writes into a hidden temporary sibling, recording each file's size and CRC-32 as it writes;
    rank 0 writes ``meta.json`` and, last, ``manifest.json``, fsyncs, moves the directory into place (an
    atomic exchange when ``path`` exists, see :mod:`~megatron_lite.core.checkpoint.commit`) and records it
    in ``latest_checkpoint.json``. A kill at any point leaves the previous checkpoint at ``path``; a full
    disk raises :class:`~megatron_lite.core.checkpoint.disk_space.CheckpointDiskFullError` on every rank
    (the bytes needed and free), the unfinished save removed and the previous checkpoint left as it was.
    The steps are :func:`begin_save`, the DCP write, :func:`finish_save` (an asynchronous writer runs the
    last two in the background, see :mod:`~megatron_lite.core.checkpoint.async_save`).
    """
    target = begin_save(path, extra, allowed, in_flight)
    writer = ChecksummingFileSystemWriter(target.tmp)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as error:
        # DCP raised the same failures on every rank: a full disk is found (and reported) by all of them.
        full = disk_full_cause(error)
        if full is not None:
            raise disk_full_error(target.path, target.tmp, full, tensor_bytes(state)) from None
        raise dcp_error(error, f"writing {target.path}") from None
    finish_save(target, writer.records)
    return target.path


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """A save under way: where its files go and what rank 0 writes beside them when they are all there."""

    path: Path
    """The checkpoint's final name."""
    tmp: Path
    """The hidden temporary sibling the files are written into."""
    meta: Optional[bytes]
    """``meta.json``'s content on rank 0 (None on the other ranks)."""
    step: Optional[int]
    """The global step recorded in ``latest_checkpoint.json``."""
    embedded: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    """The :data:`EMBEDDED_FILES` copied into :attr:`tmp` (rank 0), for the manifest."""


def begin_save(path: str | os.PathLike, extra: Optional[dict] = None, allowed: Sequence[type] = (),
               in_flight: Sequence[str | os.PathLike] = ()) -> SaveTarget:
    """Encode ``extra`` (refused before a byte is written), clean up leftovers and create the temporary
    directory (rank 0); collective."""
    path = Path(path)
    extra = dict(extra) if extra is not None else {}
    files = _embedded_names(extra.pop(EMBEDDED_FILES, None))
    meta = on_rank0(lambda: meta_json.dumps(extra, allowed), share=False)
    tmp, embedded = on_rank0(lambda: _begin_save(path, in_flight, files))
    step = extra.get("global_step")
    return SaveTarget(path, Path(tmp), meta, step if isinstance(step, int) else None, embedded)


def finish_save(target: SaveTarget, records: dict[str, FileRecord], group=None) -> None:
    """After every rank's DCP write returned: gather the ranks' file records, and rank 0 writes the
    manifest, commits and records the latest; collective (over ``group`` when given)."""
    merged: dict[str, FileRecord] = dict(target.embedded)
    for rank_records in gather_to_all(records, group):
        merged.update(rank_records)
    on_rank0(lambda: _finish_save(target.tmp, target.path, target.meta, merged, target.step), group=group)


def _embedded_names(files: Any) -> dict[str, str]:
    """The :data:`EMBEDDED_FILES` entry checked: ``<folder>/<file>`` names (no ``..``, no hidden parts)."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise TypeError(f"{EMBEDDED_FILES} must map paths inside the checkpoint to source files, got {files!r}")
    for name, source in files.items():
        parts = str(name).split("/")
        if not isinstance(name, str) or len(parts) < 2 or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"{EMBEDDED_FILES}: {name!r} is not a '<folder>/<file>' path inside the checkpoint")
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"{EMBEDDED_FILES}: the source of {name!r} must be a path, got {source!r}")
    return {name: os.fspath(source) for name, source in files.items()}


def _begin_save(path: Path, in_flight: Sequence[str | os.PathLike],
                files: dict[str, str]) -> tuple[str, dict[str, FileRecord]]:
    missing = [source for source in files.values() if not os.path.isfile(source)]
    if missing:  # before a byte is written
        raise FileNotFoundError(f"{missing[0]}, a file the checkpoint {path} is to carry, does not exist")
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_up(path.parent, in_flight)
    tmp = sibling(path, "tmp")
    tmp.mkdir()
    records = {}
    for name, source in files.items():
        data = Path(source).read_bytes()
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        write_file_durably(tmp / name, data)
        records[name] = record_bytes(data)
    for folder in {(tmp / name).parent for name in files}:
        fsync_dir(folder)
    return str(tmp), records


def _finish_save(tmp: Path, path: Path, meta: bytes, records: dict[str, FileRecord], step: Optional[int]) -> None:
    write_file_durably(tmp / META, meta)
    records = {**records, META: record_bytes(meta)}
    missing = [n for n in records if not (tmp / n).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint files {missing} were recorded but not written into {tmp}")
    write_file_durably(tmp / MANIFEST, manifest_bytes(records))
    commit(tmp, path)
    record_latest(path, step if isinstance(step, int) else None)


def load_sharded(state: dict[str, Any], path: str | os.PathLike, allowed: Sequence[type] = (),
                 verify: bool = True) -> dict:
    """Load ``state`` in place from a checkpoint written by :func:`save_sharded`; returns ``extra``.

    The path is resolved (:func:`resolve_checkpoint`) and every file checked against the manifest first
    (``verify=False`` when the caller did both); DCP then reads through the allow-list reader and
    planner, so nothing in the checkpoint is unpickled. Collective when a process group exists.
    """
    path = resolve_checkpoint(path)
    if verify:
        verify_checkpoint(path)
    read_dcp_metadata(path / ".metadata")  # a refusal raised here keeps its message (DCP would fold it into another)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as error:
        raise dcp_error(error, f"loading {path}") from None
    return read_checkpoint_meta(path, allowed)


def dcp_error(error: CheckpointException, doing: str) -> Exception:
    """DCP gathers every rank's failure into one CheckpointException (a BaseException, which Lightning's
    error handling does not expect): the failure itself, as the same error on every rank."""
    failures = sorted(error.failures.items(), key=lambda item: item[0])
    for _, (exc, _trace) in failures:
        if isinstance(exc, (UnsafeCheckpointError, CorruptCheckpointError, meta_json.CheckpointMetaError)):
            return exc
    rank, (exc, _trace) = failures[0]
    return RuntimeError(f"torch.distributed.checkpoint failed {doing} on rank {rank}: {type(exc).__name__}: {exc}")


def read_checkpoint_meta(path: str | os.PathLike, allowed: Sequence[type] = ()) -> dict:
    """The non-tensor part of a checkpoint: ``meta.json`` (see :mod:`~megatron_lite.core.checkpoint.meta_json`;
    dataclasses rebuilt only from the default config classes and ``allowed``), or for checkpoints written
    before it, ``meta.pt`` read with ``weights_only=True`` and the same classes; ``{}`` if neither is there.
    Nothing in either file can run code on load."""
    path = Path(path)
    if (path / META).is_file():
        return meta_json.loads((path / META).read_bytes(), allowed, source=str(path / META))
    legacy = path / LEGACY_META
    if not legacy.is_file():
        return {}
    classes = [*meta_json.default_config_classes(), *allowed]
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(legacy, weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(legacy))
        raise ValueError(
            f"{legacy} holds objects of types outside what a checkpoint may contain ({', '.join(unsafe) or error}); "
            f"megatron-lite never unpickles arbitrary objects. Keep hyperparameters to configs, numbers and "
            f"strings (or only load checkpoints you wrote yourself after adding their classes with "
            f"torch.serialization.add_safe_globals).") from None
