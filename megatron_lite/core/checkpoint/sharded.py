"""Sharded state dicts for DCP.

A tensor-parallel shard is presented to ``torch.distributed.checkpoint`` as a DTensor over the TP
mesh dimension (Shard along its split dim, with fused blocks seen as an extra dimension), so DCP
writes the global tensor; replicated tensors are plain and DCP keeps one copy. The views share
storage with the live parameters and optimizer state, so loading writes straight into them.
"""
from __future__ import annotations

import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from megatron_lite.core.parallel.fsdp import copy_into_sharded, full_local_tensor, is_dtensor
from megatron_lite.core.parallel.layout import ParallelLayout

# (live tensor, full tensor that DCP loads into): FSDP-sharded tensors are checkpointed through a
# gathered copy, which must be written back into the shard after loading.
WriteBacks = list[tuple[torch.Tensor, torch.Tensor]]


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
            state[name] = buf
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


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """Flattened keys stored in a DCP checkpoint (to load only what it has)."""
    reader = dcp.FileSystemReader(str(path))
    return set(reader.read_metadata().state_dict_metadata.keys())


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


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _broadcast_str(value: str) -> str:
    if not dist.is_initialized():
        return value
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def save_sharded(state: dict[str, Any], path: str | os.PathLike, extra: Optional[dict] = None) -> Path:
    """Write ``state`` with DCP (and ``extra`` with torch.save from rank 0) under ``path``, atomically.

    Everything goes to a temporary sibling directory first; rank 0 renames it into place only after
    every rank has finished, so a crash mid-save never leaves a broken checkpoint at ``path``.
    """
    path = Path(path)
    tmp = Path(_broadcast_str(str(path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")))
    if _is_rank0():
        tmp.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if _is_rank0() and extra is not None:
        torch.save(extra, tmp / "meta.pt")
    if dist.is_initialized():
        dist.barrier()
    if _is_rank0():
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    if dist.is_initialized():
        dist.barrier()
    return path


def load_sharded(state: dict[str, Any], path: str | os.PathLike, allowed: Sequence[type] = ()) -> dict:
    """Load ``state`` in place from a checkpoint written by :func:`save_sharded`; returns ``extra``
    (read by :func:`read_checkpoint_meta` with the ``allowed`` classes)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a megatron-lite checkpoint directory (no DCP .metadata inside); pass the "
            f"directory that trainer.save_checkpoint() or ModelCheckpoint wrote.")
    dcp.load(state, checkpoint_id=str(path))
    return read_checkpoint_meta(path, allowed)


def read_checkpoint_meta(path: str | os.PathLike, allowed: Sequence[type] = ()) -> dict:
    """The non-tensor part of a checkpoint (``meta.pt``: loops, schedulers, hyperparameters), read with
    ``weights_only=True``: nothing but tensors, containers, primitives and the ``allowed`` classes (the
    module's config dataclasses) is reconstructed, so a crafted file cannot run code on load."""
    meta = Path(path) / "meta.pt"
    if not meta.is_file():
        return {}
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(meta, weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(meta))
        raise ValueError(
            f"{meta} holds objects of types outside what a checkpoint may contain ({', '.join(unsafe) or error}); "
            f"megatron-lite never unpickles arbitrary objects. Keep hyperparameters to configs, numbers and "
            f"strings (or only load checkpoints you wrote yourself after adding their classes with "
            f"torch.serialization.add_safe_globals).") from None
