"""Sizes in bytes as people read them (``1.50 GiB``): a leaf of ``core``, shared by the memory estimate's reports,
the checkpoints' disk-space check and the strategy's memory check."""

from __future__ import annotations

GIB = 1024**3


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.00 MiB``, ``512 B``."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
