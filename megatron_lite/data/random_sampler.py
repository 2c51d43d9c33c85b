"""Megatron's cyclic random sampler (``--dataloader-type cyclic``): a new permutation every epoch, resumable."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator
from megatron_lite.data.samplers import GlobalBatchSampler, ramp_position


class MegatronPretrainingRandomSampler(GlobalBatchSampler):
    """Yields this rank's sample indices of each global batch in a random order that changes every epoch.

    An epoch is the ``usable = total_samples - total_samples % global_batch_size`` samples of complete global
    batches; its number is ``consumed_samples // usable`` and the permutation is drawn from a torch generator
    seeded with ``seed + epoch``, so the position ``consumed_samples`` alone fixes where a resumed run continues.

    With ``data_sharding=True`` (Megatron's default) DP rank ``r`` owns the contiguous bucket
    ``[r*usable/dp, (r+1)*usable/dp)`` and walks a permutation of it, ``global_batch_size/dp`` per step (as
    Megatron does, with seed 0 the same permutation). The buckets depend on the data-parallel size, so a run
    resumed mid-epoch with a different DP size repeats some samples and skips others until the epoch ends.
    With ``data_sharding=False`` one permutation of all usable samples is cut into global batches and rank ``r``
    takes the ``r``-th contiguous slice of each: the global order is independent of the DP size, so a resume
    after a DP change is exact (Megatron strides each rank through the permutation per microbatch instead; the
    samples of a step are the same, their assignment to ranks differs).

    Under a ramp-up (``calculator``) each step takes ``size / dp`` samples per rank in the same walk (see
    :class:`GlobalBatchSampler` for where a pass ends).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        data_sharding: bool = True,
        drop_last: bool = True,
        *,
        calculator: Optional[NumMicroBatchesCalculator] = None,
    ) -> None:
        """Validate the sizes; see the class docstring for the order produced and ``GlobalBatchSampler`` for
        ``calculator`` (a batch-size ramp-up)."""
        super().__init__(
            total_samples,
            consumed_samples,
            global_batch_size,
            num_replicas,
            rank,
            drop_last,
            more_integers=[("seed", seed, 0)],
            calculator=calculator,
        )
        self.seed = seed
        """Epoch ``e`` is shuffled with ``seed + e``."""
        self.data_sharding = data_sharding
        """Whether each rank draws from its own contiguous bucket (Megatron's default) or from one permutation."""
        self.shuffle = True
        """Kept for code that inspects DistributedSampler attributes."""
        self._cached_order: tuple[int, list[int]] = (-1, [])  # (epoch, its permutation): one draw per epoch

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (derived from ``consumed_samples``)."""
        if self.calculator is not None:
            return ramp_position(self.consumed_samples, self.usable_samples, self.calculator)[1]
        return self.consumed_samples // self.usable_samples

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Lightning calls it each epoch, but the epoch here follows from ``consumed_samples``."""

    def _permutation(self, epoch: int) -> list[int]:
        """This epoch's permutation: of the rank's bucket (``usable / dp`` samples) with sharding, else of all
        usable samples."""
        if self._cached_order[0] != epoch:
            size = self.usable_samples // self.num_replicas if self.data_sharding else self.usable_samples
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            self._cached_order = (epoch, torch.randperm(size, generator=generator).tolist())
        return self._cached_order[1]

    def _can_start_at(self, offset: int) -> bool:
        """With sharding a batch starts at ``offset / dp`` of every bucket, so ``offset`` must divide by dp."""
        return not (self.data_sharding and offset % self.num_replicas)

    def _rank_indices(self, epoch: int, offset: int, size: int) -> list[int]:
        """With sharding: the next ``size / dp`` of this rank's bucket walk; else the ``rank``-th contiguous
        slice of the batch's positions in the epoch's permutation."""
        local = size // self.num_replicas
        order = self._permutation(epoch)
        if self.data_sharding:
            bucket_start = self.rank * (self.usable_samples // self.num_replicas)
            position = offset // self.num_replicas
            return [bucket_start + i for i in order[position : position + local]]
        begin = offset + self.rank * local
        return order[begin : begin + local]

    def state_dict(self) -> dict[str, Any]:
        """The resume position and the layout it was reached with (a sharded order depends on the DP size)."""
        return {
            "consumed_samples": self.consumed_samples,
            "num_replicas": self.num_replicas,
            "data_sharding": self.data_sharding,
            "seed": self.seed,
        }
