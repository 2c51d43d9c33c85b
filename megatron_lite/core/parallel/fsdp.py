"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the data-parallel mesh dimension: ZeRO-3,
composed with our tensor parallelism.

Each transformer layer is one FSDP unit (its parameters are all-gathered just before its forward
and backward, and freed after); the embedding, final norm and output layer form the root unit.
FSDP sees the TP-local shards as ordinary tensors and shards them along dim 0 over DP only, so TP is
untouched. Two adjustments to FSDP's defaults:

- Gradients are *summed* over DP (divide factor 1): our loss is already normalised by the global
  token count, so the sum is the mean (see ``core/parallel/schedules.py``).
- ``fully_shard`` replaces parameters with new DTensor parameters; the metadata our layers attach
  (TP shard layout, init spec, sequence-parallel flag) is copied onto the new parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from megatron_lite.core.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_PARAM_METADATA = ("init_spec", "tp_shard", "sequence_parallel_grad", "tp_partial_grad", "expert_shard")


def apply_fsdp2(model: nn.Module, layout: ParallelLayout, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place over the ``dp`` mesh dimension; returns it (now an FSDP module)."""
    from torch.distributed.fsdp import fully_shard

    if layout.mesh is None:
        raise ValueError("FSDP2 needs a process group: run under MegatronStrategy (or build a ParallelLayout)")
    if layout.cp_size > 1:
        raise ValueError("FSDP2 with context parallelism is not supported yet; use cp=1 or the distributed optimizer")
    metadata = {
        name: {k: getattr(p, k) for k in _PARAM_METADATA if hasattr(p, k)} for name, p in model.named_parameters()
    }
    mesh = layout.mesh["dp"]
    for layer in getattr(model, "layers", {}).values() if hasattr(model, "layers") else []:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for name, param in model.named_parameters():
        for key, value in metadata.get(name, {}).items():
            setattr(param, key, value)
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():  # every unit reduces its own gradients
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            # A plain sum, not a pre-multiplied reduce op: gloo has no PREMUL_SUM (the factor is 1).
            unit.set_force_sum_reduction_for_comms(True)
    return model


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (FSDP2's parameters), without importing torch.distributed.tensor."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


@torch.no_grad()
def full_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole TP-local tensor behind an FSDP DTensor (all-gathered over DP); ``t`` itself otherwise."""
    return t.full_tensor() if is_dtensor(t) else t


@torch.no_grad()
def copy_into_sharded(t: torch.Tensor, full: torch.Tensor) -> None:
    """Write this DP rank's dim-0 shard of ``full`` into the FSDP DTensor ``t`` (the inverse of
    :func:`full_local_tensor`; FSDP2 shards with ``torch.chunk`` semantics)."""
    if not is_dtensor(t):
        if t.data_ptr() != full.data_ptr():
            t.copy_(full)
        return
    mesh = t.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    chunks = full.chunk(size, dim=0)
    local = t.to_local()
    if rank < len(chunks) and local.numel():
        local.copy_(chunks[rank].reshape(local.shape))
