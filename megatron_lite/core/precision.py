"""The training precisions a run may have, by Lightning's names, and how a user's spelling of one is read.

A leaf of ``core``: the run description (:class:`~megatron_lite.core.parallel.run_spec.RunSpec`) reads the
precision with it, and the memory estimate's byte tables (``core/estimator/precision_bytes.py``) are keyed by it.
"""

from __future__ import annotations

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
"""Lightning's full precision names (``Trainer(precision=...)``) that megatron-lite knows."""
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "half": "16-true"}
"""Lightning's short spellings, each to its full name."""


def normalize_precision(precision: object) -> str:
    """Lightning's precision spelling (``"bf16"``, ``16``, ``"32-true"``, ...) as one of :data:`PRECISIONS`."""
    key = str(precision)
    key = PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {sorted(PRECISIONS)}")
    return key
