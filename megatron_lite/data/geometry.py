"""Batch geometry shared by the data side and the strategy: how many samples make one step."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        """Reject non-positive sizes and a global batch that is not a whole number of microbatches."""
        _check_positive_int("micro_batch_size", self.micro_batch_size)
        _check_positive_int("global_batch_size", self.global_batch_size)
        _check_positive_int("seq_length", self.seq_length)
        if self.global_batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be divisible by micro_batch_size "
                f"({self.micro_batch_size}); change global_batch_size to a multiple of {self.micro_batch_size} "
                f"or micro_batch_size to a divisor of {self.global_batch_size}"
            )

    def num_microbatches(self, dp_size: int) -> int:
        """Microbatches per optimizer step on each data-parallel rank: gbs // (mbs * dp)."""
        _check_positive_int("dp_size", dp_size)
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be divisible by micro_batch_size "
                f"({self.micro_batch_size}) x data-parallel size ({dp_size}) = {per_step}; change "
                f"global_batch_size to a multiple of {per_step} or choose a micro_batch_size / parallel layout "
                f"whose product divides {self.global_batch_size}"
            )
        return self.global_batch_size // per_step

    def local_batch_size(self, dp_size: int) -> int:
        """Samples one data-parallel rank receives per optimizer step (gbs // dp); validates divisibility."""
        return self.num_microbatches(dp_size) * self.micro_batch_size
