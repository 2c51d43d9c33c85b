"""Parallel layout, tensor/sequence/data parallelism and the microbatch schedule."""

from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout

__all__ = ["ParallelConfig", "ParallelLayout"]
