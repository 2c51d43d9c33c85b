"""Megatron's distributed optimizer (ZeRO-1): fp32 main parameters and optimizer state sharded over
the data-parallel ranks (those of MoE experts over the expert-data-parallel ranks).

Parameters are grouped into buckets (contiguous runs of parameters, ``bucket_size`` elements or
more). Each bucket owns a flat fp32 gradient buffer, padded to a multiple of the DP size, into which
a hook accumulates every parameter's gradient over the microbatches (Megatron's ``main_grad``); the
buffer is reduce-scattered,
so rank r receives the summed gradient of slice r of every bucket. The rank keeps fp32 main
parameters (and the torch optimizer's state) for exactly those slices, steps them, and all-gathers
the updated slices back into every rank's model parameters. A parameter's slice on a rank is a
1-D view into the rank's flat fp32 shard; it joins the torch optimizer's parameter group of its
model parameter (weight decay and lr multipliers are decided from the model parameter).

Each bucket is sharded over the group its gradients are summed over (:class:`ReductionGroup`): DP x CP
for dense parameters, expert-DP for the experts of MoE layers (their own buckets, Megatron's
expert-parallel buffers); "DP" below means the bucket's group.

Per rank, with half-precision weights: 2 (weights) + 4 (fp32 gradient buffers) + 12/dp (fp32 master and
Adam's moments) = ``6 + 12/dp`` bytes per parameter, Megatron's formula. fp32 weights are their own
master copy (the optimizer steps views into them): 4 + 4 + 8/dp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.optim.build import build_optimizer
from megatron_lite.core.optim.clip_grads import counts_in_norm
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.grad_buffers import Bucket, GradBuffers, Reduction, ReductionGroup
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import _gather_first
from megatron_lite.core.timers import timed


@dataclass
class _Piece:
    """The part of one model parameter that this rank's shard owns."""

    name: str
    param: torch.Tensor
    param_lo: int
    """First owned element in the parameter's flattened order."""
    param_hi: int
    shard_lo: int
    """Where the owned elements start in this rank's shard of the bucket."""
    main: torch.Tensor
    """The fp32 main-parameter view the torch optimizer steps."""


@dataclass
class _Shard:
    """This rank's slice of one gradient bucket: the parameters' owned pieces and their fp32 masters."""

    bucket: Bucket
    pieces: list[_Piece] = field(default_factory=list)
    main_shard: Optional[torch.Tensor] = None
    """fp32 master slice for half-precision weights (fp32 weights are their own master)."""


def _is_view_of(main: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a main slice is a view into the weight itself (fp32 weights), not a master shard."""
    return main.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


class DistributedOptimizer(MegatronOptimizer):
    """ZeRO-1 over the data(-and-context)-parallel group (experts: over the expert-data-parallel group); same step
    interface as :class:`MegatronOptimizer`.

    Args:
        bucket_size: elements per gradient bucket (one reduce-scatter and one all-gather each).
        overlap_grad_reduce: launch each bucket's reduce-scatter asynchronously as soon as the last
            microbatch's backward has produced all of its gradients, overlapping the communication
            with the rest of the backward (Megatron's ``--overlap-grad-reduce``).
    """

    buffer_reduction: Reduction = "reduce_scatter"
    grad_buffers: GradBuffers
    """Always there: ZeRO-1 reduce-scatters its own buffers (FSDP is MegatronOptimizer's)."""

    def __init__(
        self,
        model: nn.Module,
        config: OptimizerConfig,
        layout: ParallelLayout,
        fp16: bool = False,
        bucket_size: Optional[int] = None,
        overlap_grad_reduce: bool = False,
        build: Callable = build_optimizer,
    ) -> None:
        super().__init__(
            model,
            config,
            layout,
            fp16=fp16,
            grad_reduction="all_reduce",
            build=build,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
        )

    @property
    def bucket_size(self) -> int:
        return self.grad_buffers.bucket_size

    # --- main parameters: this rank's slices ------------------------------------------------
    @torch.no_grad()
    def _main_param_entries(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        self.masters = {}
        self.shards: list[_Shard] = []
        entries = []
        for bucket in self.grad_buffers.buckets:
            shard = _Shard(bucket)
            self.shards.append(shard)
            lo, hi = bucket.group.rank * bucket.shard_size, (bucket.group.rank + 1) * bucket.shard_size
            # fp32 weights are their own main copy (the slices are views into them, as in Megatron);
            # half-precision weights get an fp32 master shard.
            if bucket.dtype != torch.float32:
                device = bucket.params[0][1].device
                shard.main_shard = torch.zeros(bucket.shard_size, dtype=torch.float32, device=device)
            for (name, param), offset in zip(bucket.params, bucket.offsets):
                start, end = max(lo, offset), min(hi, offset + param.numel())
                if start >= end:
                    continue
                param_lo, param_hi, shard_lo = start - offset, end - offset, start - lo
                if shard.main_shard is None:
                    main = param.data.view(-1)[param_lo:param_hi]
                else:
                    main = shard.main_shard[shard_lo : shard_lo + end - start]
                    main.copy_(param.detach().reshape(-1)[param_lo:param_hi])
                piece = _Piece(name, param, param_lo, param_hi, shard_lo, main)
                shard.pieces.append(piece)
                entries.append((name, param, piece.main))
        return entries

    def _pieces(self):
        return (piece for shard in self.shards for piece in shard.pieces)

    def main_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(piece.param, piece.main) for piece in self._pieces()]

    def zero_grad(self) -> None:
        super().zero_grad()
        for piece in self._pieces():
            piece.main.grad = None

    # --- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """SP gradients over TP, then each bucket's fp32 gradient buffer reduce-scattered over its group (DP x CP,
        or expert-DP) into the main gradients of this rank's slices."""
        self.grad_buffers.reduce()
        for shard in self.shards:
            reduced = self.grad_buffers.reduced_shard(shard.bucket)
            for piece in shard.pieces:
                piece.main.grad = reduced[piece.shard_lo : piece.shard_lo + piece.param_hi - piece.param_lo]

    def collect_main_grads(self) -> None:
        """Done by :meth:`reduce_gradients` (the reduce-scatter lands in the main gradients)."""

    def norm_inputs(self):
        # Slices are disjoint across the ranks of each bucket's group; a TP- (ETP-) replicated parameter's slices
        # are the same on every TP (ETP) rank, so only its rank 0 counts them. Summed over every rank.
        grads = [
            piece.main.grad
            for piece in self._pieces()
            if piece.main.grad is not None and counts_in_norm(piece.param, self.layout, sliced_over_dp=True)
        ]
        return grads, None, True

    @torch.no_grad()
    def finish_step(self, result) -> None:
        """All-gather every bucket's updated slices into the model parameters of every DP rank."""
        if result.skipped:
            return
        with timed(self.timers, "params-all-gather"):
            self.publish_params()

    def _owned_shard(self, shard: _Shard) -> torch.Tensor:
        """This rank's slice of the bucket as one flat fp32 tensor (assembled from the views into
        fp32 weights when there is no separate master shard)."""
        if shard.main_shard is not None:
            return shard.main_shard
        flat = torch.zeros(shard.bucket.shard_size, dtype=torch.float32, device=shard.bucket.buffer.device)
        for piece in shard.pieces:
            flat[piece.shard_lo : piece.shard_lo + piece.main.numel()].copy_(piece.main)
        return flat

    @torch.no_grad()
    def publish_params(self) -> None:
        for shard in self.shards:
            bucket = shard.bucket
            if bucket.group.size == 1 and shard.main_shard is None:
                continue  # the only rank updated the weights in place
            full = _gather_first(self._owned_shard(shard).to(bucket.dtype), bucket.group.group)
            for (_, param), offset in zip(bucket.params, bucket.offsets):
                param.data.copy_(full[offset : offset + param.numel()].view_as(param))

    # --- checkpoints: gathered to the plain optimizer's per-parameter format ---------------------
    @torch.no_grad()
    def _gather_per_param(
        self, shard: _Shard, local_of: Callable[[_Piece], Optional[torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        bucket = shard.bucket
        flat = torch.zeros(bucket.shard_size, dtype=torch.float32, device=bucket.buffer.device)
        for piece in shard.pieces:
            value = local_of(piece)
            if value is not None:
                flat[piece.shard_lo : piece.shard_lo + value.numel()].copy_(value)
        full = _gather_first(flat, bucket.group.group)
        return {
            name: full[offset : offset + p.numel()].view(p.shape).clone()
            for (name, p), offset in zip(bucket.params, bucket.offsets)
        }

    @torch.no_grad()
    def master_weights(self) -> dict[str, torch.Tensor]:
        """Every half-precision parameter's fp32 master, gathered over DP into the parameter's shape; collective
        over the data-parallel group (and the expert-data-parallel one for experts)."""
        masters: dict[str, torch.Tensor] = {}
        for shard in self.shards:
            if shard.main_shard is not None:
                masters.update(self._gather_per_param(shard, lambda piece: piece.main))
        return masters

    @torch.no_grad()
    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's optimizer state and fp32 master, gathered over its bucket's group into the parameter's
        shape (fresh tensors: load them with :meth:`load_checkpoint_state` after filling them)."""
        state: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in self.named_params}
        for group in self._groups():
            shards = [shard for shard in self.shards if shard.bucket.group == group]
            keys, scalars = self._state_keys(shards, group)
            for shard in shards:
                for key in keys:
                    gathered = self._gather_per_param(shard, functools.partial(self._state_slice, key))
                    for name, value in gathered.items():
                        state[name][key] = value
                if shard.main_shard is not None:  # fp32 weights are their own master: saved with the model
                    for name, value in self._gather_per_param(shard, lambda pc: pc.main).items():
                        state[name]["master"] = value
                for key, value in scalars.items():
                    for name, _ in shard.bucket.params:
                        state[name][key] = value.clone()
        return state

    def _groups(self) -> list[ReductionGroup]:
        """The buckets' groups, in bucket order (dense, then experts): every rank of a group holds the same
        parameters, hence the same buckets of that group."""
        groups: list[ReductionGroup] = []
        for shard in self.shards:
            if shard.bucket.group not in groups:
                groups.append(shard.bucket.group)
        return groups

    def _state_slice(self, key: str, piece: _Piece) -> Optional[torch.Tensor]:
        """This rank's slice of ``piece``'s optimizer state ``key`` (None before its first step)."""
        return self.optimizer.state.get(piece.main, {}).get(key)

    def _state_keys(self, shards: list[_Shard], group: ReductionGroup) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Names of per-element state tensors of ``shards``, and their scalar entries (Adam's step), agreed across
        ``group``."""
        keys: list[str] = []
        scalars: dict[str, torch.Tensor] = {}
        for piece in (piece for shard in shards for piece in shard.pieces):
            for key, value in self.optimizer.state.get(piece.main, {}).items():
                if torch.is_tensor(value) and value.ndim == 0:
                    scalars.setdefault(key, value)
                elif key not in keys:
                    keys.append(key)
        # Every rank must run the same gathers even if it owns no slice of some bucket.
        mine = (sorted(keys), {k: float(v) for k, v in scalars.items()})
        agreed: list = [mine]
        if group.size > 1:
            agreed = [None] * group.size
            dist.all_gather_object(agreed, mine, group=group.group)
        all_keys = sorted({k for ks, _ in agreed for k in ks})
        all_scalars: dict[str, torch.Tensor] = {}
        for _, sc in agreed:
            for k, v in sc.items():
                all_scalars[k] = torch.tensor(max(v, float(all_scalars.get(k, v))), dtype=torch.float32)
        return all_keys, all_scalars

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Copy this rank's slices out of full per-parameter tensors (loaded from a checkpoint)."""
        for piece in self._pieces():
            entry = state.get(piece.name, {})
            master = entry.get("master")
            if master is not None or not _is_view_of(piece.main, piece.param):
                # A separate fp32 master shard: from the checkpoint's masters, else from the loaded weights.
                source = master if master is not None else piece.param.detach()
                piece.main.copy_(source.reshape(-1)[piece.param_lo : piece.param_hi])
            opt_state = self.optimizer.state.get(piece.main, {})
            for key, value in entry.items():
                if key == "master" or key not in opt_state:
                    continue
                if value.ndim == 0:
                    opt_state[key].copy_(value)
                else:
                    opt_state[key].copy_(value.reshape(-1)[piece.param_lo : piece.param_hi])
        self.publish_params()
