"""Lightning callbacks of megatron-lite: Megatron's training metrics (throughput, MFU, timers, console log)."""
from megatron_lite.callbacks.metrics import MegatronMetrics

__all__ = ["MegatronMetrics"]
