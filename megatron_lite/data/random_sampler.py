"""Megatron's cyclic random sampler (``--dataloader-type cyclic``): a new permutation every epoch, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_lite.data.samplers import GlobalBatchSampler


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
    ) -> None:
        """Validate the sizes; see the class docstring for the order produced."""
        super().__init__(total_samples, consumed_samples, global_batch_size, num_replicas, rank, drop_last,
                         more_integers=[("seed", seed, 0)])
        self.seed = seed
        """Epoch ``e`` is shuffled with ``seed + e``."""
        self.data_sharding = data_sharding
        """Whether each rank draws from its own contiguous bucket (Megatron's default) or from one permutation."""
        self.shuffle = True
        """Kept for code that inspects DistributedSampler attributes."""

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (derived from ``consumed_samples``)."""
        return self.consumed_samples // self.usable_samples

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Lightning calls it each epoch, but the epoch here follows from ``consumed_samples``."""

    def _permutation(self, size: int, epoch: int) -> list[int]:
        """The permutation of ``range(size)`` for ``epoch``."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the epoch."""
        start = self.consumed_samples % self.usable_samples
        if start + self.global_batch_size > self.usable_samples or (self.data_sharding and start % self.num_replicas):
            # off the global-batch grid (the batch size changed): finish this epoch's leftovers by skipping them
            self.consumed_samples += self.usable_samples - start
            start = 0
        epoch = self.epoch
        if self.data_sharding:
            bucket = self.usable_samples // self.num_replicas
            offset = self.rank * bucket
            order = [offset + i for i in self._permutation(bucket, epoch)[start // self.num_replicas:]]
        else:
            permutation = self._permutation(self.usable_samples, epoch)
            first = self.rank * self.local_batch_size
            order = []
            for batch_start in range(start, self.usable_samples - self.global_batch_size + 1, self.global_batch_size):
                order += permutation[batch_start + first: batch_start + first + self.local_batch_size]
        for i in range(0, len(order) - self.local_batch_size + 1, self.local_batch_size):
            yield from order[i: i + self.local_batch_size - 1]
            # advance before the last index leaves, so a consumer that stops right after a complete batch
            # (without resuming the generator) still sees the batch counted
            self.consumed_samples += self.global_batch_size
            yield order[i + self.local_batch_size - 1]

    def state_dict(self) -> dict[str, Any]:
        """The resume position and the layout it was reached with (a sharded order depends on the DP size)."""
        return {"consumed_samples": self.consumed_samples, "num_replicas": self.num_replicas,
                "data_sharding": self.data_sharding, "seed": self.seed}
