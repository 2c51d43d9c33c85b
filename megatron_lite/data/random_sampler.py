"""Megatron's cyclic random sampler (``--dataloader-type cyclic``): a new permutation every epoch, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler


class MegatronPretrainingRandomSampler(DistributedSampler):
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

    It subclasses ``DistributedSampler`` only so Lightning keeps it instead of wrapping or replacing it; the
    parent's ``__init__`` is not called (it needs a dataset and a process group this sampler does not use).
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
        for name, value, minimum in (
            ("total_samples", total_samples, 1),
            ("global_batch_size", global_batch_size, 1),
            ("num_replicas", num_replicas, 1),
            ("consumed_samples", consumed_samples, 0),
            ("rank", rank, 0),
            ("seed", seed, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if rank >= num_replicas:
            raise ValueError(f"rank ({rank}) must be < num_replicas ({num_replicas}); pass the data-parallel rank")
        if global_batch_size % num_replicas != 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by the data-parallel size "
                f"({num_replicas}); change global_batch_size to a multiple of {num_replicas}")
        if total_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {total_samples} samples, fewer than one global batch ({global_batch_size}); "
                f"lower global_batch_size or seq_length, or use more data")
        if not drop_last:
            # a trailing partial global batch would give DP ranks different batch sizes and hang collectives
            raise ValueError("MegatronPretrainingRandomSampler only supports drop_last=True; pass drop_last=True")
        self.total_samples = total_samples
        """Samples in the dataset."""
        self.consumed_samples = consumed_samples
        """Samples (over all ranks) consumed so far, counted across epochs; advanced while iterating."""
        self.global_batch_size = global_batch_size
        """Samples per optimizer step over all data-parallel ranks."""
        self.num_replicas = num_replicas
        """Data-parallel size."""
        self.rank = rank
        """Data-parallel rank of this process."""
        self.seed = seed
        """Epoch ``e`` is shuffled with ``seed + e``."""
        self.data_sharding = data_sharding
        """Whether each rank draws from its own contiguous bucket (Megatron's default) or from one permutation."""
        self.drop_last = drop_last
        """Always True: incomplete trailing global batches are skipped."""
        self.shuffle = True
        """Kept for code that inspects DistributedSampler attributes."""
        self.local_batch_size = global_batch_size // num_replicas
        """Samples this rank receives per global batch."""
        self.usable_samples = total_samples - total_samples % global_batch_size
        """Samples in complete global batches: the length of one epoch."""
        self.num_samples = self.usable_samples // num_replicas
        self.total_size = self.usable_samples

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (derived from ``consumed_samples``)."""
        return self.consumed_samples // self.usable_samples

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Lightning calls it each epoch, but the epoch here follows from ``consumed_samples``."""

    def __len__(self) -> int:
        """Indices this rank yields in one full epoch (constant, independent of the resume point)."""
        return self.num_samples

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by ``state_dict``."""
        self.consumed_samples = int(state_dict["consumed_samples"])
