"""Megatron's pretraining sampler: sequential global batches, one contiguous slice per DP rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator


class GlobalBatchSampler(DistributedSampler):
    """What Megatron's samplers share: validated sizes, whole global batches split evenly over the DP ranks,
    and the resume position ``consumed_samples``; subclasses define which indices a global batch holds
    (``_rank_indices``).

    A pass (epoch) holds ``usable = total_samples - total_samples % global_batch_size`` samples. With a
    ``calculator`` (a batch-size ramp-up) the global batch of each step has the size the calculator gives for the
    samples consumed before it; a batch that no longer fits in the pass starts the next pass (the rest of the
    pass is skipped, as a trailing partial batch is). Iterate with ``iter_batches`` then (a DataLoader's
    ``batch_sampler``, see :class:`RankBatchSampler`): plain ``__iter__`` yields the same indices unbatched.

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
        calculator: Optional[NumMicroBatchesCalculator] = None,
    ) -> None:
        """Validate the sizes (ValueError naming the fix) and set the attributes both samplers have.

        ``more_integers`` holds ``(name, value, minimum)`` of a subclass's own integer arguments, checked with
        the common ones. ``calculator`` gives the global batch of each step (a ramp-up); it must be built for
        ``global_batch_size`` and ``num_replicas``.
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
        if calculator is not None and (calculator.global_batch_size, calculator.data_parallel_size) != (
            global_batch_size,
            num_replicas,
        ):
            raise ValueError(
                f"the calculator is for global_batch_size {calculator.global_batch_size} at data-parallel size "
                f"{calculator.data_parallel_size}, the sampler for {global_batch_size} at {num_replicas}; build it "
                f"with the sampler's sizes"
            )

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
        self.calculator = calculator
        """Global batch size of each step from the samples consumed before it; None: always global_batch_size."""
        self.read_ahead: Optional[Callable[[list[int]], None]] = None
        """Called with this rank's next batch when a batch is taken, to start its reads early (the loader sets it
        to the dataset's ``prefetch_samples`` when the dataset is read in this process); None: no read-ahead."""
        self.local_batch_size = global_batch_size // num_replicas
        """Samples this rank receives per full-size global batch."""
        self.usable_samples = total_samples - total_samples % global_batch_size
        """Samples in complete global batches: the length of one pass (epoch)."""
        # DistributedSampler's public size attributes, with the same meaning
        self.num_samples = self.usable_samples // num_replicas
        self.total_size = self.usable_samples

    def __len__(self) -> int:
        """Indices this rank yields in one full pass at the full batch size (independent of the resume point)."""
        return self.num_samples

    def _can_start_at(self, offset: int) -> bool:
        """Whether a global batch may begin at ``offset`` of a pass (a subclass's layout may forbid some)."""
        return True

    def _rank_indices(self, epoch: int, offset: int, size: int) -> list[int]:
        """This rank's indices of the global batch of ``size`` samples at ``offset`` of pass ``epoch``."""
        raise NotImplementedError

    def _global_batches(self) -> Iterator[tuple[int, int, int]]:
        """``(epoch, offset, size)`` of each global batch from the current position to the end of its pass.

        The consumer advances ``consumed_samples`` by ``size`` per batch it takes (see ``__iter__``).
        """
        usable, full = self.usable_samples, self.global_batch_size
        if self.calculator is None:
            start = self.consumed_samples % usable
            if start + full > usable or not self._can_start_at(start):
                # a position off the global-batch grid (e.g. after a batch-size change) can leave less than a
                # global batch in this pass: move on to the next pass instead of yielding nothing
                self.consumed_samples += usable - start
                start = 0
            epoch = self.consumed_samples // usable
            for offset in range(start, usable - full + 1, full):
                yield epoch, offset, full
            return
        consumed, epoch, offset = ramp_position(self.consumed_samples, usable, self.calculator)
        self.consumed_samples = consumed
        while True:
            size = self.calculator.global_batch_size_at(consumed)
            if offset + size > usable:
                return  # the pass is over; the next iteration starts the next one
            yield epoch, offset, size
            offset += size
            consumed += size

    def _rank_batches(self) -> Iterator[tuple[int, list[int]]]:
        """``(global batch size, this rank's indices)`` of each step to the end of the pass; as each is taken, the
        next one's indices go to :attr:`read_ahead`.

        Looking one batch ahead changes nothing: the walk's position lives in its own variables and
        ``consumed_samples`` is advanced by the consumer, batch by batch.
        """
        batches = ((size, self._rank_indices(epoch, offset, size)) for epoch, offset, size in self._global_batches())
        following = next(batches, None)
        while following is not None:
            batch, following = following, next(batches, None)
            if following is not None and self.read_ahead is not None:
                self.read_ahead(following[1])
            yield batch

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the pass."""
        for size, indices in self._rank_batches():
            yield from indices[:-1]
            # advance before the last index leaves, so a consumer that stops right after a complete
            # batch (without resuming the generator) still sees the batch counted
            self.consumed_samples += size
            yield indices[-1]

    def iter_batches(self) -> Iterator[list[int]]:
        """Yield this rank's batch of each step (``size / num_replicas`` indices) to the end of the pass."""
        for size, indices in self._rank_batches():
            self.consumed_samples += size
            yield indices

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by ``state_dict``."""
        self.consumed_samples = int(state_dict["consumed_samples"])


class MegatronPretrainingSampler(GlobalBatchSampler):
    """Yields this rank's sample indices of each global batch, starting at ``consumed_samples``.

    Global batch ``k`` covers indices ``[k*G, (k+1)*G)``; rank ``r`` of ``dp`` gets the contiguous slice
    ``[k*G + r*G/dp, k*G + (r+1)*G/dp)``. Only complete global batches are used. Iteration starts at
    ``consumed_samples % usable`` (the position in the current pass) and runs to the end of the pass;
    the counter advances as indices are yielded, so the following ``__iter__`` starts the next pass at 0.
    Under a ramp-up the batches are consecutive too, each of the size the calculator gives.
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
        calculator: Optional[NumMicroBatchesCalculator] = None,
    ) -> None:
        """Validate the sizes; see the class docstring for the order produced.

        ``rewind=True`` makes every ``__iter__`` start at the initial ``consumed_samples`` instead of where the
        previous iteration stopped: for evaluation, so each validation run sees the same batches even when
        Lightning stops early (``limit_val_batches``). ``calculator`` ramps the batch size up (see
        :class:`GlobalBatchSampler`).
        """
        super().__init__(
            total_samples, consumed_samples, global_batch_size, num_replicas, rank, drop_last, calculator=calculator
        )
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

    def _global_batches(self) -> Iterator[tuple[int, int, int]]:
        """The base class's walk, from the initial position when rewinding."""
        if self.rewind:
            self.consumed_samples = self.initial_consumed_samples
        yield from super()._global_batches()

    def _rank_indices(self, epoch: int, offset: int, size: int) -> list[int]:
        """The ``rank``-th contiguous slice of the batch's samples ``[offset, offset + size)``."""
        local = size // self.num_replicas
        begin = offset + self.rank * local
        return list(range(begin, begin + local))

    def state_dict(self) -> dict[str, Any]:
        """The resume position: samples consumed over all ranks."""
        return {"consumed_samples": self.consumed_samples}


class RankBatchSampler(Sampler[list[int]]):
    """A DataLoader ``batch_sampler``: this rank's batch of each step from ``sampler.iter_batches()``, whose size
    may change from step to step (a batch-size ramp-up).

    It has no ``__len__`` on purpose: the number of steps in a pass changes as the batch grows, and Lightning
    takes the length once per fit. Without one, Lightning ends each epoch when the pass runs out.
    """

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        """Wrap ``sampler``; it keeps the resume position."""
        super().__init__()
        self.sampler = sampler
        """The sampler whose batches this yields (Lightning calls its ``set_epoch``)."""

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batch of each step, to the end of the pass."""
        return self.sampler.iter_batches()


def ramp_position(consumed_samples: int, usable: int, calculator: NumMicroBatchesCalculator) -> tuple[int, int, int]:
    """Where a run that took the calculator's batches from 0 stands after ``consumed_samples`` samples:
    ``(consumed, epoch, offset)`` of its next global batch, each pass holding ``usable`` samples and a batch that
    does not fit in the rest of a pass starting the next one.

    ``consumed`` is ``consumed_samples`` itself when that is a step boundary of the schedule; otherwise (a
    position saved with other batch sizes) the first boundary after it.
    """
    full = calculator.global_batch_size
    consumed = epoch = offset = 0

    def next_fitting(epoch: int, offset: int, size: int) -> tuple[int, int]:
        return (epoch + 1, 0) if offset + size > usable else (epoch, offset)

    while consumed < consumed_samples:
        size = calculator.global_batch_size_at(consumed)
        epoch, offset = next_fitting(epoch, offset, size)
        if size == full:
            # the batch never shrinks: the remaining steps are all full ones, counted without walking them
            steps = -(-(consumed_samples - consumed) // full)
            consumed += steps * full
            in_this_pass = (usable - offset) // full
            if steps <= in_this_pass:
                offset += steps * full
            else:
                per_pass = usable // full
                steps -= in_this_pass
                epoch, offset = epoch + 1 + steps // per_pass, steps % per_pass * full
            break
        offset += size
        consumed += size
    epoch, offset = next_fitting(epoch, offset, calculator.global_batch_size_at(consumed))
    return consumed, epoch, offset
