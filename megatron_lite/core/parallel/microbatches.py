"""Megatron's number-of-microbatches calculators: a constant global batch, or one that ramps up with the samples
consumed (``--rampup-batch-size start increment samples``).

Megatron keeps one calculator in a module global; here the caller builds one with
:func:`build_num_microbatches_calculator` and passes it where it is needed. The calculators keep Megatron's
``update`` / ``get`` / ``get_current_global_batch_size`` API; ``global_batch_size_at`` is the same rule as a pure
function, for code (the samplers) that must know future batch sizes without changing the calculator's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a batch size is always a config mistake
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; set it to an integer >= 1")


def _check_consumed(consumed_samples: object) -> None:
    if isinstance(consumed_samples, bool) or not isinstance(consumed_samples, int) or consumed_samples < 0:
        raise ValueError(f"consumed_samples must be an integer >= 0, got {consumed_samples!r}")


def _check_multiple(name: str, value: int, micro_batch_size: int, data_parallel_size: int) -> None:
    unit = micro_batch_size * data_parallel_size
    if value % unit:
        raise ValueError(
            f"{name} ({value}) must be a multiple of micro_batch_size ({micro_batch_size}) x data-parallel size "
            f"({data_parallel_size}) = {unit}, so that every rank runs whole microbatches; set {name} to a "
            f"multiple of {unit} (e.g. {max(unit, value // unit * unit)}) or change micro_batch_size / the "
            f"device count"
        )


class NumMicroBatchesCalculator:
    """Base of the calculators (Megatron's API) over ``global_batch_size_at``, the rule a subclass defines."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    current_global_batch_size: int
    num_micro_batches: int

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Global batch of the step that starts after ``consumed_samples`` consumed samples."""
        raise NotImplementedError

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Set the current global batch and microbatch count for ``consumed_samples``. ``consistency_check`` is
        Megatron's flag; the divisibility it checks was proven for every batch size at construction."""
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        self.num_micro_batches = self.current_global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def get(self) -> int:
        """Microbatches per DP rank of the current step."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Global batch of the current step."""
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        """Samples per microbatch."""
        return self.micro_batch_size


@dataclass
class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """The same global batch, and so the same number of microbatches per DP rank, at every step."""

    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank."""
    data_parallel_size: int
    """Number of data-parallel ranks."""
    current_global_batch_size: int = field(init=False)
    """Global batch of the step at the last ``update`` (always ``global_batch_size`` here)."""
    num_micro_batches: int = field(init=False)
    """Microbatches per DP rank of that step: ``current_global_batch_size // (micro_batch_size * dp)``."""

    def __post_init__(self) -> None:
        """Reject non-positive sizes and a global batch that is not whole microbatches on every DP rank."""
        _check_positive_int("global_batch_size", self.global_batch_size)
        _check_positive_int("micro_batch_size", self.micro_batch_size)
        _check_positive_int("data_parallel_size", self.data_parallel_size)
        _check_multiple("global_batch_size", self.global_batch_size, self.micro_batch_size, self.data_parallel_size)
        self.update(0)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Always ``global_batch_size``."""
        _check_consumed(consumed_samples)
        return self.global_batch_size


@dataclass
class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Megatron's batch-size ramp-up: the global batch grows from ``start_global_batch_size`` by
    ``batch_size_increment`` every ``rampup_samples / ((global_batch_size - start) / increment)`` consumed samples
    and is ``global_batch_size`` once more than ``rampup_samples`` samples were consumed."""

    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks once the ramp-up is over."""
    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank."""
    data_parallel_size: int
    """Number of data-parallel ranks."""
    start_global_batch_size: int
    """Global batch of the first step."""
    batch_size_increment: int
    """Samples the global batch grows by at each ramp-up stage."""
    rampup_samples: int
    """Consumed samples over which the batch grows from the start to ``global_batch_size``."""
    rampup_samples_per_increment: float = field(init=False)
    """Consumed samples between two increments (a float, as in Megatron; infinite without a ramp)."""
    current_global_batch_size: int = field(init=False)
    """Global batch of the step at the last ``update``."""
    num_micro_batches: int = field(init=False)
    """Microbatches per DP rank of that step: ``current_global_batch_size // (micro_batch_size * dp)``."""

    def __post_init__(self) -> None:
        """Reject sizes that cannot ramp up in whole increments or that leave a rank a partial microbatch."""
        for name in ("global_batch_size", "micro_batch_size", "data_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        for position, name in enumerate(("start_global_batch_size", "batch_size_increment", "rampup_samples")):
            _check_positive_int(f"rampup_batch_size[{position}] ({name})", getattr(self, name))
        if self.start_global_batch_size > self.global_batch_size:
            raise ValueError(
                f"the ramp-up start batch rampup_batch_size[0] ({self.start_global_batch_size}) exceeds "
                f"global_batch_size ({self.global_batch_size}); ramp-up only grows the batch: set "
                f"rampup_batch_size[0] <= {self.global_batch_size}"
            )
        difference = self.global_batch_size - self.start_global_batch_size
        if difference % self.batch_size_increment:
            raise ValueError(
                f"global_batch_size - start ({self.global_batch_size} - {self.start_global_batch_size} = "
                f"{difference}) must be divisible by the increment ({self.batch_size_increment}); set "
                f"rampup_batch_size[1] to a divisor of {difference}, or change the start or global_batch_size"
            )
        # start and increment multiples of mbs x dp make every batch of the ramp (and the last) one as well
        _check_multiple(
            "rampup_batch_size[0] (the start batch)",
            self.start_global_batch_size,
            self.micro_batch_size,
            self.data_parallel_size,
        )
        _check_multiple(
            "rampup_batch_size[1] (the increment)",
            self.batch_size_increment,
            self.micro_batch_size,
            self.data_parallel_size,
        )
        increments = difference // self.batch_size_increment
        # start == global_batch_size: nothing to ramp (Megatron divides by zero here)
        self.rampup_samples_per_increment = self.rampup_samples / increments if increments else float("inf")
        self.update(0)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Megatron's rule: ``global_batch_size`` past ``rampup_samples``, else ``start + int(consumed /
        samples_per_increment) * increment``."""
        _check_consumed(consumed_samples)
        if consumed_samples > self.rampup_samples:
            return self.global_batch_size
        increments = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start_global_batch_size + increments * self.batch_size_increment


def build_num_microbatches_calculator(
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    rampup_batch_size: Optional[Sequence[int]] = None,
) -> NumMicroBatchesCalculator:
    """A constant calculator, or a ramp-up one for ``rampup_batch_size = [start, increment, rampup_samples]``
    (Megatron's ``--rampup-batch-size``). Bad sizes raise ValueError saying what to change."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size)
    if (
        isinstance(rampup_batch_size, (str, bytes))
        or not isinstance(rampup_batch_size, Sequence)
        or len(rampup_batch_size) != 3
    ):
        raise ValueError(
            f"rampup_batch_size must be [start_global_batch_size, batch_size_increment, "
            f"rampup_samples], got {rampup_batch_size!r}"
        )
    start, increment, samples = rampup_batch_size
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        start_global_batch_size=start,
        batch_size_increment=increment,
        rampup_samples=samples,
    )


def consumed_samples_after(calculator: NumMicroBatchesCalculator, steps: int) -> int:
    """Samples consumed by the first ``steps`` optimizer steps of a run that starts at 0 consumed samples."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    consumed = 0
    for taken in range(steps):
        size = calculator.global_batch_size_at(consumed)
        if size == calculator.global_batch_size:
            # the batch never shrinks: every remaining step is a full one
            return consumed + (steps - taken) * size
        consumed += size
    return consumed
