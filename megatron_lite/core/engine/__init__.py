"""The training engine shared by every objective (see DESIGN.md §2 "The engine")."""

from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.engine.engine import Objective, TrainingEngine, WholeModel, model_parts
from megatron_lite.core.parallel.loss_report import report_entry, split_loss, with_report

__all__ = [
    "EngineModule",
    "Objective",
    "TrainingEngine",
    "WholeModel",
    "model_parts",
    "report_entry",
    "split_loss",
    "with_report",
]
