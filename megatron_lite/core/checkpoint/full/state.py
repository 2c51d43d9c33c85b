"""Whole models as full global tensors: gathered from any layout's shards, loaded into any layout.

Used to hand a model across processes: forked ranks hand the trained model back to the notebook that
launched them (one process, one full model), and a model built for one layout is carried into a model
built for another (the notebook's one-process model into TP2 ranks). Names are the module's own
parameter names, which do not depend on the layout (layers are keyed by their global index).

Gathering goes through the same metadata the distributed checkpoints use (each parameter's
``tp_shard`` and, for an MoE layer's experts, ``expert_shard``; FSDP2 DTensors): every rank of a layout calls
:func:`gather_full_state` (collectives over TP -- ETP and EP for experts, which are saved as the tensors of all
experts -- and FSDP's DP); the ranks that hold a distinct piece of the model -- data-parallel rank 0 of each
tensor-parallel group, and with pipeline parallelism one such rank per stage -- get the tensors and write
them with :func:`write_full_state`, one safetensors file each; :func:`read_full_state` merges the files.

Loading (:func:`load_full_state`, :func:`carry_over_state`) is local: each rank cuts its own shard out
of the full tensor. Vocabulary padding depends on the TP size (Megatron pads to a multiple of
``make_vocab_size_divisible_by x tp``) and is no part of the model: a full state holds exactly the real
``vocab_size`` rows of the embedding and output layer (:attr:`TPShard.real_shape`), and loading pads them
with zero rows for the layout at hand. A tensor with more rows than that (padded by someone else) is cut
to its first ``vocab_size`` rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, save_safetensors
from megatron_lite.core.checkpoint.resume.entries import compare_entries, persistent_buffers
from megatron_lite.core.parallel.fsdp import full_local_tensor, is_dtensor
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import (
    ExpertShard,
    TPShard,
    full_shape,
    gather_full_tensor,
    local_shard,
)

FORMAT = "megatron-lite-full-state/1"


def holds_distinct_piece(layout: ParallelLayout) -> bool:
    """Whether this rank writes its piece of the model: the first rank of its stage's replica (TP, CP
    and DP rank 0). Without pipeline parallelism that is global rank 0 only."""
    return layout.tp_rank == 0 and layout.dp_rank == 0 and layout.cp_rank == 0


@torch.no_grad()
def gather_full_state(
    module: nn.Module, layout: ParallelLayout, substitutes: Optional[dict[str, torch.Tensor]] = None
) -> Optional[dict[str, torch.Tensor]]:
    """Full global tensors (on the CPU) of ``module``'s parameters and persistent buffers; ``substitutes`` (by
    parameter name, shaped like the parameter's TP-local tensor) are gathered in their parameters' place: the
    fp32 masters of a half-precision model.

    Collective: every rank of the layout must call it (FSDP2 all-gathers over DP, TP shards over the TP
    group, experts over ETP and EP). Returns the tensors on the ranks that :func:`holds_distinct_piece`, None on
    the others.
    """
    keep = holds_distinct_piece(layout)
    substitutes = substitutes or {}
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        local = substitutes[name] if name in substitutes else full_local_tensor(param.detach())
        full = gather_full_tensor(local, param, layout)
        if keep:
            state[name] = full.to("cpu", copy=True).contiguous()
    for name, buf in persistent_buffers(module):
        # A buffer split over TP like its layer (a quantizer's per-channel amax) carries a tp_shard too
        full = gather_full_tensor(full_local_tensor(buf.detach()), buf, layout)
        if keep:
            state[name] = full.to("cpu", copy=True).contiguous()
    return state if keep else None


def write_full_state(state: dict[str, torch.Tensor], directory: str | os.PathLike, rank: int) -> Path:
    """Write one rank's piece as ``directory/rank<rank>.safetensors``."""
    path = Path(directory) / f"rank{rank:05d}.safetensors"
    save_safetensors(state, path, metadata={"format": FORMAT, "rank": str(rank)})
    return path


def read_full_state(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Merge every piece written by :func:`write_full_state` into one state. A name written by two
    ranks (a tied embedding held by the first and the last pipeline stage) keeps one value."""
    files = sorted(Path(directory).glob("rank*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model pieces (rank*.safetensors) in {directory}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        tensors, metadata = load_safetensors(path)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a megatron-lite full-state file (format {metadata.get('format')!r})")
        for name, tensor in tensors.items():
            if name in state and state[name].shape != tensor.shape:
                raise ValueError(
                    f"{name} has shape {tuple(state[name].shape)} in one piece and {tuple(tensor.shape)} in {path.name}"
                )
            state.setdefault(name, tensor)
    return state


def _vocab_of(param: torch.Tensor, vocab_size: Optional[int]) -> Optional[int]:
    """The real vocabulary of a padded parameter (known from its shard), else the caller's ``vocab_size``."""
    shard: Optional[TPShard] = getattr(param, "tp_shard", None)
    return shard.unpadded_size if shard is not None and shard.unpadded_size is not None else vocab_size


def _adapt_vocab(
    name: str, full: torch.Tensor, shape: tuple[int, ...], vocab_size: Optional[int]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``full`` as a tensor of ``shape``, and a mask of the entries it fixes (None: all of them).

    Only a difference in vocabulary padding is bridged: one dimension in which both sizes are at least
    ``vocab_size``; its first ``vocab_size`` rows are the real ones."""
    if tuple(full.shape) == shape:
        return full, None
    differ = [d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b]
    if (
        len(full.shape) != len(shape)
        or len(differ) != 1
        or vocab_size is None
        or min(full.shape[differ[0]], shape[differ[0]]) < vocab_size
    ):
        raise ValueError(
            f"{name}: the full tensor has shape {tuple(full.shape)}, the model expects {shape}; "
            f"the weights belong to a model with another configuration"
        )
    d = differ[0]
    index = [slice(None)] * len(shape)
    index[d] = slice(0, vocab_size)
    out = torch.zeros(shape, dtype=full.dtype)
    out[tuple(index)] = full[tuple(index)]
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[tuple(index)] = True
    return out, mask


def _assign(param: torch.Tensor, tp_local: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    """Copy this rank's TP-local tensor ``tp_local`` into ``param`` (where ``mask`` is set), cutting
    the DP shard out first when ``param`` is an FSDP2 DTensor (``torch.chunk`` along dim 0)."""
    target = param.data
    if is_dtensor(target):
        mesh = target.device_mesh
        rank, size = mesh.get_local_rank(), mesh.size()
        local = target.to_local()
        chunks = tp_local.chunk(size, dim=0)
        if rank >= len(chunks) or local.numel() == 0:
            return
        tp_local = chunks[rank].reshape(local.shape)
        mask = mask.chunk(size, dim=0)[rank].reshape(local.shape) if mask is not None else None
        target = local
    tp_local = tp_local.to(device=target.device, dtype=target.dtype)
    if mask is None:
        target.copy_(tp_local)
    else:
        target.copy_(torch.where(mask.to(target.device), tp_local, target))


@torch.no_grad()
def load_full_state(
    module: nn.Module, state: dict[str, torch.Tensor], *, vocab_size: Optional[int] = None, strict: bool = True
) -> None:
    """Load full global tensors into ``module``, built for any layout (each rank keeps its shard).

    With ``strict`` the names of ``state`` must be exactly ``module``'s parameters and persistent buffers
    (ValueError naming the missing and unexpected ones); ``strict=False`` loads the names both have, the others
    keep their values. ``vocab_size`` lets the real vocabulary rows cross a change of vocabulary padding.
    Local: no collective.
    """
    params = dict(module.named_parameters())
    buffers = dict(persistent_buffers(module))
    mismatch = compare_entries([*params, *buffers], state)
    if strict and mismatch:
        raise ValueError(f"the weights do not fit {type(module).__name__}: {mismatch.describe()}")
    params = {n: p for n, p in params.items() if n in state}
    buffers = {n: b for n, b in buffers.items() if n in state}
    for name, param in params.items():
        full, mask = _adapt_vocab(name, state[name], full_shape(param), _vocab_of(param, vocab_size))
        _assign(param, local_shard(param, full), local_shard(param, mask) if mask is not None else None)
    for name, buf in buffers.items():
        full, mask = _adapt_vocab(name, state[name], full_shape(buf), vocab_size)
        _assign(buf, local_shard(buf, full), local_shard(buf, mask) if mask is not None else None)


def same_layout(a: Optional[ParallelLayout], b: Optional[ParallelLayout]) -> bool:
    """Whether a model built for layout ``a`` can run under layout ``b``: the same object, or two
    one-process layouts (which hold no process group)."""
    if a is None or b is None:
        return a is b
    return a is b or (a.mesh is None and b.mesh is None and a.world_size == b.world_size == 1 and a.config == b.config)


@torch.no_grad()
def carry_over_state(previous: nn.Module, model: nn.Module, *, vocab_size: Optional[int] = None) -> None:
    """Copy ``previous``'s weights into ``model``, built for another layout of the same processes, without
    a collective (``previous``'s process groups may be gone).

    Each parameter of ``previous`` is either whole (a one-process model, or replicated over TP) -- then
    ``model`` cuts its own shard out of it -- or a shard; a shard is copied only into the same shard of
    the same tensor (the same TP rank and size; for an expert's weight also the same EP rank and size). Any
    other change of layout needs the full tensors: gather them while the old layout lives
    (:func:`gather_full_state`) and :func:`load_full_state`.
    """
    old = dict(previous.named_parameters())
    for name, param in model.named_parameters():
        if name not in old:
            raise ValueError(f"cannot carry the weights over: the previous model has no parameter {name}")
        source = old[name].detach()
        old_shard: Optional[TPShard] = getattr(old[name], "tp_shard", None)
        new_shard: Optional[TPShard] = getattr(param, "tp_shard", None)
        old_experts: Optional[ExpertShard] = getattr(old[name], "expert_shard", None)
        new_experts: Optional[ExpertShard] = getattr(param, "expert_shard", None)
        if is_dtensor(source):
            if (
                not is_dtensor(param.data)
                or (old_shard, old_experts) != (new_shard, new_experts)
                or source.shape != param.shape
                or source.device_mesh.mesh.tolist() != param.data.device_mesh.mesh.tolist()
            ):
                raise ValueError(
                    f"cannot carry {name} over from an FSDP2-sharded model to another layout in "
                    f"place; save a checkpoint and load it with ckpt_path=... instead"
                )
            param.data.to_local().copy_(source.to_local())
            continue
        if old_experts is not None and old_experts.size > 1:
            if (old_shard, old_experts) != (new_shard, new_experts):
                size, rank = (new_experts.size, new_experts.rank) if new_experts is not None else (1, 0)
                raise ValueError(
                    f"cannot carry {name} over from expert-parallel size {old_experts.size} (rank {old_experts.rank}) "
                    f"to {size} (rank {rank}) or another expert tensor-parallel split in place; save a checkpoint and "
                    f"load it with ckpt_path=... instead"
                )
            _assign(param, source, None)
            continue
        if old_shard is not None and old_shard.size > 1:
            if old_shard != new_shard:
                size, rank = (new_shard.size, new_shard.rank) if new_shard is not None else (1, 0)
                raise ValueError(
                    f"cannot carry {name} over from tensor-parallel size {old_shard.size} (rank {old_shard.rank}) to "
                    f"{size} (rank {rank}) in place; save a checkpoint and load it with ckpt_path=... instead"
                )
            _assign(param, source, None)
            continue
        if old_shard is not None:
            source = old_shard.unpad(source)  # the real rows of a whole (one-TP-rank) tensor
        full, mask = _adapt_vocab(name, source, full_shape(param), _vocab_of(param, vocab_size))
        _assign(param, local_shard(param, full), local_shard(param, mask) if mask is not None else None)
    old_buffers = dict(persistent_buffers(previous))
    for name, buf in persistent_buffers(model):
        if name in old_buffers and old_buffers[name].shape == buf.shape:
            buf.copy_(old_buffers[name])
