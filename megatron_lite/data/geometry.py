"""Batch geometry: :class:`DataGeometry` lives in ``core`` (the run description and the estimator read it too);
the data side declares it and keeps this import path."""

from megatron_lite.core.parallel.geometry import DataGeometry, declared_geometry

__all__ = ["DataGeometry", "declared_geometry"]
