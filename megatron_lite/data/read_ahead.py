"""Read-ahead in a rank's own order: the sampler, which knows this rank's next batch, hands its indices to the
dataset, which starts their reads in the background (an object store's ``.bin``; see
:mod:`~megatron_lite.data.remote_file`).

A dataset takes part by having ``prefetch_samples(indices)`` (:class:`ReadsAhead`); wrappers (a blend, the padded
evaluation split) forward each index to the dataset that holds it. The loader connects the two only where the
dataset is read in the sampler's process (``num_workers=0``): with worker processes the announcement could not reach
the copy of the dataset that reads, and the DataLoader's own prefetch (``prefetch_factor`` batches per worker) reads
ahead instead. Either way only this rank's samples are fetched, never the indices that follow one in the dataset
(which under data parallelism belong to the other ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ReadsAhead(Protocol):
    """A dataset that can start reading samples before they are asked for."""

    def prefetch_samples(self, indices: Sequence[int]) -> None:
        """Start the reads of samples ``indices`` in the background; return at once."""


def prefetch_samples(dataset: Any, indices: Sequence[int]) -> None:
    """``dataset.prefetch_samples(indices)`` for a dataset that reads ahead (:class:`ReadsAhead`); nothing otherwise."""
    if indices and isinstance(dataset, ReadsAhead):
        dataset.prefetch_samples(indices)
