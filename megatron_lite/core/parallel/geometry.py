"""Batch geometry: how many samples make one optimizer step. The data side declares it (a datamodule's
``geometry``); the strategy's run description (:class:`~megatron_lite.core.parallel.run_spec.RunSpec`) and the
estimator read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator, build_num_microbatches_calculator


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a batch size is always a config mistake
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; set {name}=<int >= 1>")


@dataclass(frozen=True)
class DataGeometry:
    """Sizes that fix what one optimizer step consumes; validated on construction."""

    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    seq_length: int
    """Tokens per sample fed to the model (each stored sample holds seq_length + 1 tokens)."""
    rampup_batch_size: Optional[Sequence[int]] = None
    """Megatron's ``[start, increment, rampup_samples]``: training batches grow from ``start`` to
    ``global_batch_size`` over ``rampup_samples`` consumed samples; None keeps ``global_batch_size`` throughout.
    Stored as a tuple."""

    def __post_init__(self) -> None:
        """Reject non-positive sizes, a global batch that is not a whole number of microbatches, and a ramp-up
        whose batches are not (the checks that need the data-parallel size run in ``num_microbatches`` and
        ``num_microbatches_calculator``, which the run description calls)."""
        _check_positive_int("micro_batch_size", self.micro_batch_size)
        _check_positive_int("global_batch_size", self.global_batch_size)
        _check_positive_int("seq_length", self.seq_length)
        self.num_microbatches(1)  # whole microbatches at all (each data-parallel size is checked by the run)
        if self.rampup_batch_size is not None:
            ramp = self.rampup_batch_size
            # a tuple keeps the frozen geometry hashable; a malformed value is left for the calculator to reject
            object.__setattr__(self, "rampup_batch_size", tuple(ramp) if isinstance(ramp, (list, tuple)) else ramp)
            self.num_microbatches_calculator(1)

    def num_microbatches(self, dp_size: int) -> int:
        """Microbatches per optimizer step on each data-parallel rank: gbs // (mbs * dp) (see
        :func:`num_microbatches`)."""
        return num_microbatches(self.global_batch_size, self.micro_batch_size, dp_size)

    def local_batch_size(self, dp_size: int) -> int:
        """Samples one data-parallel rank receives per optimizer step (gbs // dp); validates divisibility."""
        return self.num_microbatches(dp_size) * self.micro_batch_size

    def num_microbatches_calculator(self, dp_size: int) -> NumMicroBatchesCalculator:
        """The batch-size schedule of training at data-parallel size ``dp_size`` (constant without ramp-up);
        raises ValueError naming the fix when a batch is not whole microbatches on every rank."""
        _check_positive_int("dp_size", dp_size)
        return build_num_microbatches_calculator(
            self.global_batch_size, self.micro_batch_size, dp_size, self.rampup_batch_size
        )


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """``global_batch_size // (micro_batch_size * dp_size)``: the one check that a global batch splits into whole
    microbatches on every data-parallel rank (a ValueError naming the fix otherwise)."""
    _check_positive_int("dp_size", dp_size)
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step != 0:
        example = max(per_step, global_batch_size // per_step * per_step)
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size ({micro_batch_size}) x "
            f"data-parallel size ({dp_size}) = {per_step}; change global_batch_size to a multiple of {per_step} (e.g. "
            f"{example}) or change micro_batch_size / the device count (the parallel layout) so that their product "
            f"divides {global_batch_size}"
        )
    return global_batch_size // per_step


def declared_geometry(datamodule: Any) -> Optional[DataGeometry]:
    """The batch geometry ``datamodule`` declares as its ``geometry`` (every ``PretrainingDataModule`` does), or
    None: a datamodule without one (predict-only prompts, a hand-written one) gets no batch checks or estimates."""
    geometry = getattr(datamodule, "geometry", None)
    return geometry if isinstance(geometry, DataGeometry) else None
