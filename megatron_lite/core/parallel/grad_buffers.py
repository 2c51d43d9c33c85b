"""Gradient buffers and their data-parallel reduction (what Megatron's DistributedDataParallel wrapper does).

Parameters are grouped into buckets (contiguous runs of parameters, ``bucket_size`` elements or more,
one dtype, one reduction group). Each bucket owns a flat fp32 buffer, padded to a multiple of its group's
size; a hook adds every fresh gradient of a parameter into its slice of the buffer (Megatron's
``main_grad``) and frees it, so gradients accumulate over microbatches in fp32 whatever the parameter's
dtype. After the backward passes each bucket is reduced over its group: all-reduced (every rank gets
the whole summed gradient: the plain optimizer) or reduce-scattered (rank r gets slice r: the
distributed optimizer). Dense parameters are reduced over the data(-and-context)-parallel group
('dp_cp'); the experts of MoE layers (:func:`~megatron_lite.core.parallel.tensor_parallel.is_expert_parameter`)
have buckets of their own, reduced over the expert-data-parallel group ('edp': the ranks that hold a copy
of the same experts, Megatron's expert_data_parallel_group). With ``overlap`` a bucket's reduction is launched
asynchronously from the hook as soon as all its parameters' gradients of the step's last backward
have arrived, overlapping communication with the rest of the backward.

Owning this outside the optimizer lets any schedule drive it: a schedule wraps every backward but
the last one of each model chunk in :meth:`no_sync`, and the optimizer step calls :meth:`reduce`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.data_parallel import reduce_partial_grads
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import _reduce_scatter_single
from megatron_lite.core.parallel.tensor_parallel import is_expert_parameter

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron's default (at least 1M x dp)

Reduction = Literal["all_reduce", "reduce_scatter"]


@dataclass(frozen=True)
class ReductionGroup:
    """The ranks a bucket's gradients are summed (and ZeRO-1's state sharded) over."""

    name: str
    """The layout's group: 'dp_cp' for dense parameters, 'edp' for the experts of MoE layers."""
    group: Optional[dist.ProcessGroup]
    """The process group; None when this rank is alone in it."""
    size: int
    """Ranks in the group."""
    rank: int
    """This rank's index in the group: the slice of each bucket it receives from a reduce-scatter."""

    @classmethod
    def of(cls, layout: ParallelLayout, name: str) -> "ReductionGroup":
        group = layout.group(name)
        if group is None:
            return cls(name, None, 1, 0)
        return cls(name, group, dist.get_world_size(group), dist.get_rank(group))


def reduction_group_name(param: torch.Tensor) -> str:
    """The layout group ``param``'s gradient is summed over: 'edp' for an expert's weights, else 'dp_cp'."""
    return "edp" if is_expert_parameter(param) else "dp_cp"


@dataclass
class Bucket:
    """A run of parameters sharing one flat fp32 gradient buffer and one collective."""

    params: list[tuple[str, torch.Tensor]]
    offsets: list[int]
    """Where each parameter starts in the bucket's flat order."""
    numel: int
    padded: int
    """``numel`` rounded up to a multiple of the reduction group's size."""
    shard_size: int
    """``padded / group size``: the slice each rank of the group receives from a reduce-scatter."""
    dtype: torch.dtype
    """The parameters' dtype (the buffer itself is fp32)."""
    buffer: torch.Tensor
    """The flat fp32 gradient buffer, ``padded`` elements on the parameters' device."""
    group: ReductionGroup
    """The ranks its gradients are summed over (dense: DP x CP; experts: expert-DP)."""
    ready: int = 0
    """Parameters whose gradient of the last backward has arrived (overlapped reduction)."""
    pending: Optional[tuple[Optional[dist.Work], torch.Tensor]] = None
    """(async work or None, reduced tensor): the launched reduction and where its result lands."""

    def view(self, index: int) -> torch.Tensor:
        """The buffer slice of the ``index``-th parameter, shaped like it."""
        param = self.params[index][1]
        offset = self.offsets[index]
        return self.buffer[offset : offset + param.numel()].view(param.shape)


def make_buckets(
    named_params: Sequence[tuple[str, torch.Tensor]], bucket_size: int, group: ReductionGroup
) -> list[Bucket]:
    """Consecutive parameters of one dtype, closed once ``bucket_size`` elements are reached, each with its
    zeroed buffer padded to a multiple of ``group``'s size."""
    dp = group.size
    buckets: list[Bucket] = []
    current: list[tuple[str, torch.Tensor]] = []

    def close() -> None:
        if not current:
            return
        offsets, total = [], 0
        for _, p in current:
            offsets.append(total)
            total += p.numel()
        padded = -(-total // dp) * dp
        first = current[0][1]
        buffer = torch.zeros(padded, dtype=torch.float32, device=first.device)
        buckets.append(Bucket(list(current), offsets, total, padded, padded // dp, first.dtype, buffer, group))
        current.clear()

    size = 0
    for name, param in named_params:
        if current and (param.dtype != current[0][1].dtype or size >= bucket_size):
            close()
            size = 0
        current.append((name, param))
        size += param.numel()
    close()
    return buckets


class GradBuffers:
    """fp32 gradient buckets of ``named_params`` with their DP reduction.

    Args:
        named_params: the parameters (name, tensor) that train, in model order.
        layout: the parallel layout (DP, expert-DP and TP groups).
        reduction: ``"all_reduce"`` or ``"reduce_scatter"``, over the dp x cp group for dense parameters and
            over the expert-data-parallel group for experts (in buckets of their own, after the dense ones).
        bucket_size: elements per bucket (default max(40M, 1M x dp), Megatron's).
        overlap: launch each bucket's reduction during the backward (see the module docstring).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        layout: ParallelLayout,
        reduction: Reduction = "all_reduce",
        bucket_size: Optional[int] = None,
        overlap: bool = False,
    ) -> None:
        self.layout, self.reduction, self.overlap = layout, reduction, overlap
        dense = ReductionGroup.of(layout, "dp_cp")
        self.bucket_size = bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * dense.size)
        # Experts last, in buckets of their own (Megatron's expert-parallel buffers): every rank of a group
        # issues that group's collectives in the same order.
        self.buckets: list[Bucket] = []
        for group in (dense, ReductionGroup.of(layout, "edp")):
            members = [(n, p) for n, p in named_params if reduction_group_name(p) == group.name]
            self.buckets += make_buckets(members, self.bucket_size, group)
        self._where: dict[str, tuple[Bucket, int]] = {}
        self._hooks: list = []
        self._sync = True
        self.overlapped_reductions = 0
        """Bucket reductions launched during a backward so far (observability, tests)."""
        for bucket in self.buckets:
            for index, (name, param) in enumerate(bucket.params):
                self._where[name] = (bucket, index)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(bucket, index)))

    def _hook(self, bucket: Bucket, index: int):
        view = bucket.view(index)
        name = bucket.params[index][0]

        def accumulate(param: torch.Tensor) -> None:
            if param.grad is None:
                raise RuntimeError(
                    f"the gradient of {name} was already taken by another set of gradient buffers on the same "
                    f"parameters: call remove_hooks() on the previous optimizer before building a new one"
                )
            view.add_(param.grad.reshape(view.shape))
            param.grad = None
            if self.overlap and self._sync:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    bucket.pending = self._launch(bucket, async_op=True)
                    self.overlapped_reductions += 1

        return accumulate

    def __getstate__(self) -> dict:
        # Hook handles belong to this process's parameters: a pickled or copied module carries none.
        state = dict(self.__dict__)
        state["_hooks"] = []
        return state

    def remove_hooks(self) -> None:
        """Detach from the parameters (a later backward leaves its gradients in ``param.grad``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def main_grad(self, name: str) -> torch.Tensor:
        """``name``'s accumulated gradient (a view into its bucket, shaped like the parameter)."""
        bucket, index = self._where[name]
        return bucket.view(index)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate: no reduction is launched during them."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.pending = 0, None

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish every bucket's reduction (launching those not overlapped) and wait for them."""
        if self.overlap:
            missed = [i for i, bucket in enumerate(self.buckets) if bucket.pending is None]
            if missed and len(missed) < len(self.buckets):
                # Launching these now would order the collectives differently from ranks that launched
                # them during the backward (Megatron asserts the same).
                raise RuntimeError(
                    f"overlap_grad_reduce: gradient bucket(s) {missed} did not receive every parameter's "
                    f"gradient during the backward (parameters unused in this step?); set "
                    f"MegatronStrategy(overlap_grad_reduce=False) for models with unused parameters."
                )
        for bucket in self.buckets:
            if bucket.pending is None:
                bucket.pending = self._launch(bucket, async_op=False)
            work, _ = bucket.pending
            if work is not None:
                work.wait()

    def reduced_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of the reduced bucket (reduce-scatter; the whole buffer for all-reduce)."""
        if bucket.pending is None:
            raise RuntimeError("reduced_shard() reads the result of reduce(): call reduce() first")
        return bucket.pending[1]

    def _launch(self, bucket: Bucket, async_op: bool) -> tuple[Optional[dist.Work], torch.Tensor]:
        """The bucket's gradients that are partial per TP rank summed over TP (an expert bucket's over ETP), then
        its reduction over its group (DP x CP, or expert-DP); returns the launched reduction (its work when
        ``async_op``) and where its result lands."""
        reduce_partial_grads(((p, bucket.view(i).view(-1)) for i, (_, p) in enumerate(bucket.params)), self.layout)
        group = bucket.group
        if self.reduction == "all_reduce":
            work = None
            if group.size > 1:
                work = dist.all_reduce(bucket.buffer, group=group.group, async_op=async_op)
            return work if async_op else None, bucket.buffer
        if group.size == 1:
            return None, bucket.buffer[: bucket.shard_size]
        shard = torch.empty(bucket.shard_size, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        work = _reduce_scatter_single(shard, bucket.buffer, group=group.group, async_op=async_op)
        return work if async_op else None, shard
