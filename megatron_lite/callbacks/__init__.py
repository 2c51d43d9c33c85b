"""Lightning callbacks of megatron-lite: Megatron's training metrics (throughput, MFU, timers, console log)."""
from megatron_lite.callbacks.metrics import MegatronMetrics
from megatron_lite.callbacks.pipeline_timeline import PipelineTimeline

__all__ = ["MegatronMetrics", "PipelineTimeline"]
