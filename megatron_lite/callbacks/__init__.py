"""Lightning callbacks of megatron-lite: Megatron's training metrics (throughput, MFU, timers, console log)
and fault tolerance (graceful exit on signals and budgets, the rerun state machine, a hang watchdog,
a straggler report) and post-training (Distill, Quantize, TrainDraftHead)."""

from megatron_lite.callbacks.distill import Distill
from megatron_lite.callbacks.draft_head import TrainDraftHead
from megatron_lite.callbacks.graceful_exit import GracefulExit
from megatron_lite.callbacks.lora import LoRA
from megatron_lite.callbacks.metrics import MegatronMetrics
from megatron_lite.callbacks.pipeline_timeline import PipelineTimeline
from megatron_lite.callbacks.quantize import Quantize
from megatron_lite.callbacks.rerun import RerunValidation
from megatron_lite.callbacks.straggler import StragglerReport
from megatron_lite.callbacks.watchdog import HangWatchdog

__all__ = [
    "Distill",
    "GracefulExit",
    "HangWatchdog",
    "LoRA",
    "MegatronMetrics",
    "PipelineTimeline",
    "Quantize",
    "RerunValidation",
    "StragglerReport",
    "TrainDraftHead",
]
