"""Megatron's pretraining sampler: sequential global batches, one contiguous slice per DP rank."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data.distributed import DistributedSampler


class GlobalBatchSampler(DistributedSampler):
    """What Megatron's samplers share: validated sizes, whole global batches split evenly over the DP ranks,
    and the resume position ``consumed_samples``; subclasses define the order (``__iter__``).

    It subclasses ``DistributedSampler`` only so that Lightning recognises the samplers as already distributed
    and does not wrap or replace them; the parent's ``__init__`` is not called because it needs a dataset and
    an initialised process group, neither of which these samplers use.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        drop_last: bool = True,
        more_integers: Sequence[tuple[str, Any, int]] = (),
    ) -> None:
        """Validate the sizes (ValueError naming the fix) and set the attributes both samplers have.

        ``more_integers`` holds ``(name, value, minimum)`` of a subclass's own integer arguments, checked with
        the common ones.
        """
        for name, value, minimum in (
            ("total_samples", total_samples, 1),
            ("global_batch_size", global_batch_size, 1),
            ("num_replicas", num_replicas, 1),
            ("consumed_samples", consumed_samples, 0),
            ("rank", rank, 0),
            *more_integers,
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if rank >= num_replicas:
            raise ValueError(f"rank ({rank}) must be < num_replicas ({num_replicas}); pass the data-parallel rank")
        if global_batch_size % num_replicas != 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by the data-parallel size "
                f"({num_replicas}); change global_batch_size to a multiple of {num_replicas}"
            )
        if total_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {total_samples} samples, fewer than one global batch ({global_batch_size}); "
                f"lower global_batch_size or seq_length, or use more data"
            )
        if not drop_last:
            # a trailing partial global batch would give DP ranks different batch sizes and hang collectives
            raise ValueError(f"{type(self).__name__} only supports drop_last=True; pass drop_last=True")

        self.total_samples = total_samples
        """Samples in the dataset."""
        self.consumed_samples = consumed_samples
        """Samples (over all ranks) consumed so far, counted across passes; advanced while iterating."""
        self.global_batch_size = global_batch_size
        """Samples per optimizer step over all data-parallel ranks."""
        self.num_replicas = num_replicas
        """Data-parallel size."""
        self.rank = rank
        """Data-parallel rank of this process."""
        self.drop_last = drop_last
        """Always True: incomplete trailing global batches are skipped."""
        self.local_batch_size = global_batch_size // num_replicas
        """Samples this rank receives per global batch."""
        self.usable_samples = total_samples - total_samples % global_batch_size
        """Samples in complete global batches: the length of one pass (epoch)."""
        # DistributedSampler's public size attributes, with the same meaning
        self.num_samples = self.usable_samples // num_replicas
        self.total_size = self.usable_samples

    def __len__(self) -> int:
        """Indices this rank yields in one full pass (constant, independent of the resume point)."""
        return self.num_samples

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by ``state_dict``."""
        self.consumed_samples = int(state_dict["consumed_samples"])


class MegatronPretrainingSampler(GlobalBatchSampler):
    """Yields this rank's sample indices of each global batch, starting at ``consumed_samples``.

    Global batch ``k`` covers indices ``[k*G, (k+1)*G)``; rank ``r`` of ``dp`` gets the contiguous slice
    ``[k*G + r*G/dp, k*G + (r+1)*G/dp)``. Only complete global batches are used. Iteration starts at
    ``consumed_samples % usable`` (the position in the current pass) and runs to the end of the pass;
    the counter advances as indices are yielded, so the following ``__iter__`` starts the next pass at 0.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        drop_last: bool = True,
        *,
        rewind: bool = False,
    ) -> None:
        """Validate the sizes; see the class docstring for the order produced.

        ``rewind=True`` makes every ``__iter__`` start at the initial ``consumed_samples`` instead of where the
        previous iteration stopped: for evaluation, so each validation run sees the same batches even when
        Lightning stops early (``limit_val_batches``).
        """
        super().__init__(total_samples, consumed_samples, global_batch_size, num_replicas, rank, drop_last)
        self.rewind = rewind
        """Whether each ``__iter__`` restarts at ``initial_consumed_samples``."""
        self.initial_consumed_samples = consumed_samples
        """Position given at construction; where a rewinding sampler always starts."""
        self.epoch = 0
        """Set by Lightning through ``set_epoch``; does not change the order."""
        self.shuffle = False
        """Order is sequential; kept for code that inspects DistributedSampler attributes."""
        self.seed = 0
        """Unused; kept for code that inspects DistributedSampler attributes."""

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (Lightning calls this each epoch); the order does not depend on it."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the pass."""
        if self.rewind:
            self.consumed_samples = self.initial_consumed_samples
        start = self.consumed_samples % self.usable_samples
        if start + self.global_batch_size > self.usable_samples:
            # a position that is not a multiple of the global batch (e.g. after a batch-size change) can leave
            # less than a global batch in this pass: move on to the next pass instead of yielding nothing
            self.consumed_samples += self.usable_samples - start
            start = 0
        first = self.rank * self.local_batch_size
        last_start = self.usable_samples - self.global_batch_size
        for batch_start in range(start, last_start + 1, self.global_batch_size):
            begin = batch_start + first
            yield from range(begin, begin + self.local_batch_size - 1)
            # advance before the last index leaves, so a consumer that stops right after a complete
            # batch (without resuming the generator) still sees the batch counted
            self.consumed_samples += self.global_batch_size
            yield begin + self.local_batch_size - 1

    def state_dict(self) -> dict[str, Any]:
        """The resume position: samples consumed over all ranks."""
        return {"consumed_samples": self.consumed_samples}
