"""The training engine shared by every objective (see DESIGN.md §2 "The engine")."""
from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.engine.engine import Objective, TrainingEngine, WholeModel, model_parts

__all__ = ["EngineModule", "Objective", "TrainingEngine", "WholeModel", "model_parts"]
