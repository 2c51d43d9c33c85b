"""A run's live state as DCP state dicts: model and optimizer tensors presented as their global tensors.

A tensor-parallel shard is presented to ``torch.distributed.checkpoint`` as a DTensor over the TP mesh
dimension (Shard along its split dim, with fused blocks seen as an extra dimension), so DCP writes the global
tensor; replicated tensors are plain and DCP keeps one copy. The views share storage with the live parameters
and optimizer state, so loading writes straight into them. FSDP2-sharded tensors go through a gathered copy,
written back into the shard after a load (:data:`WriteBacks`).

Optimizer state is keyed by the module's parameter names (``state.<param name>.<key>``), which do not depend
on the layout: a plain ``torch.optim`` optimizer's (:func:`sharded_optimizer_state`) and a
:class:`~megatron_lite.core.optim.MegatronOptimizer`'s alike -- the latter in the same keys whatever its
DP sharding (ZeRO-1) or precision, with its fp32 masters as ``master`` (:func:`megatron_optimizer_state`,
:func:`megatron_optimizer_load_state`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from megatron_lite.core.parallel.fsdp import copy_into_sharded, full_local_tensor, is_dtensor
from megatron_lite.core.parallel.layout import ParallelLayout

WriteBacks = list[tuple[torch.Tensor, torch.Tensor]]
"""(live tensor, full tensor that DCP loads into): FSDP-sharded tensors are checkpointed through a gathered
copy, which must be written back into the shard after loading (:func:`write_back`)."""


def _global_view(tensor: torch.Tensor, param: torch.Tensor, layout: ParallelLayout):
    experts = getattr(param, "expert_shard", None)
    shard = getattr(param, "tp_shard", None)
    if experts is not None:
        return _experts_view(tensor, shard, experts, layout)
    if shard is None:
        return tensor
    if shard.unpadded_size is not None:
        return _real_rows_view(tensor, shard, layout)
    view, global_shape, dim = shard.blocked_view(tensor)
    if shard.size == 1 or layout.mesh is None:
        # Still the blocked view (e.g. [2, ffn, h] for fused gate/up): the saved shape must not
        # depend on the TP size, or a TP1 checkpoint could not be loaded at TP2.
        return view
    from torch.distributed.tensor import Shard

    return _dtensor(view, layout.mesh["tp"], [Shard(dim)], global_shape)


def _experts_view(tensor: torch.Tensor, shard, experts, layout: ParallelLayout):
    """An MoE layer's expert weight as its tensor of all experts ``[num_experts, ...]`` (fused blocks as their own
    dimension, as for the dense layers), sharded along dimension 0 over EP and along its split dimension over ETP:
    the saved tensor does not depend on EP, ETP or TP. Without an expert mesh (EP 1, ETP = TP) the ETP group is
    TP's."""
    from torch.distributed.tensor import Shard

    if shard is not None:
        view, global_shape, dim = shard.blocked_view(tensor)
    else:  # whole over ETP (fc2's bias): replicated there
        view, global_shape, dim = tensor, tuple(tensor.shape), None
    global_shape = experts.global_shape(global_shape)
    split_over_etp = shard is not None and shard.size > 1
    if layout.expert_mesh is not None:
        dims = [("ep", Shard(0))] if experts.size > 1 else []
        dims += [("etp", Shard(dim))] if split_over_etp else []
        if not dims:
            return view
        mesh = layout.expert_mesh[tuple(name for name, _ in dims)]
    elif split_over_etp and layout.mesh is not None:  # EP 1 and ETP = TP: the ETP split is over TP's mesh dimension
        dims, mesh = [("tp", Shard(dim))], layout.mesh["tp"]
    else:
        return view
    return _dtensor(view, mesh, [placement for _, placement in dims], global_shape)


def _dtensor(local, mesh, placements, global_shape):
    from torch.distributed.tensor import DTensor

    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


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
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if real > 0:
        offsets = [0] * tensor.ndim
        offsets[dim] = shard.local_start
        rows = LocalShardsWrapper([local], [tuple(offsets)])
    else:  # this rank holds only padding: nothing of it is written, nothing read into it (the empty
        # wrapper describes a 2-D tensor: vocabulary tensors are [vocab, hidden])
        rows = LocalShardsWrapper([], [])
    return _dtensor(rows, layout.mesh["tp"], [Shard(dim)], shard.real_shape)


def _checkpoint_view(
    tensor: torch.Tensor, param: torch.Tensor, layout: ParallelLayout, writebacks: Optional[WriteBacks]
) -> torch.Tensor:
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


def sharded_model_state(
    module: nn.Module, layout: ParallelLayout, writebacks: Optional[WriteBacks] = None
) -> dict[str, Any]:
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


def megatron_optimizer_state(
    optimizer,
    layout: ParallelLayout,
    prefix: str = "",
    writebacks: Optional[WriteBacks] = None,
    per_param: Optional[dict[str, dict[str, torch.Tensor]]] = None,
) -> dict[str, Any]:
    """A :class:`~megatron_lite.core.optim.MegatronOptimizer`'s state in the keys of
    :func:`sharded_optimizer_state` (``state.<prefix><param name>.<key>``; ``prefix``: where the optimizer's model
    sits in the checkpointed module, ``"model."`` in a GPTModule), from its ``checkpoint_state()`` (or
    ``per_param``), plus ``extra`` (loss scaler, skipped steps) and the param groups' hyperparameters."""
    per_param = optimizer.checkpoint_state() if per_param is None else per_param
    params_by_name = dict(optimizer.named_params)
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


def megatron_optimizer_load_state(
    optimizer,
    layout: ParallelLayout,
    keys: set[str],
    key_prefix: str,
    prefix: str = "",
    writebacks: Optional[WriteBacks] = None,
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """What to load a checkpoint (its flattened DCP ``keys``; this optimizer's under ``key_prefix``, e.g.
    ``"optimizer_0."``) into: :func:`megatron_optimizer_state` holding only what the checkpoint has (no fp32 masters
    when it was written at another precision, no state for parameters not stepped yet); and the function to call
    with it once DCP loaded it in place, which refreshes the masters and shards, drops the state of unstepped
    parameters and restores the loss scaler. The param groups' hyperparameters are the caller's
    (:func:`load_optimizer_groups`). Call ``optimizer.ensure_state()`` first, so there is state to load into."""
    per_param = optimizer.checkpoint_state()
    present = {
        name: {k: v for k, v in entry.items() if f"{key_prefix}state.{prefix}{name}.{k}" in keys}
        for name, entry in per_param.items()
    }
    absent = {
        name
        for name, entry in present.items()
        if not any(k != "master" for k in entry) and any(k != "master" for k in per_param[name])
    }
    state = megatron_optimizer_state(optimizer, layout, prefix, writebacks, per_param=present)
    if not any(k.startswith(f"{key_prefix}extra") for k in keys):
        state.pop("extra")  # written before loss scaling existed

    def finish(loaded: dict[str, Any]) -> None:
        optimizer.load_checkpoint_state(present)
        optimizer.drop_state(absent)
        optimizer.load_state_dict_extra(loaded.get("extra", {}))

    return state, finish


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
        raise ValueError(
            f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(optimizer.param_groups)}"
        )
    for group, saved_group in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
